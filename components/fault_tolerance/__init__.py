"""Fault tolerance across replica groups through torchft: quorum, gradient averaging, healing."""
