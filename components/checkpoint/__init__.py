"""Checkpoints: the manager over torch.distributed.checkpoint, their integrity, the Stateful parts
of a run, and Hugging Face folders."""
