"""Optimizers, the learning-rate schedule, gradient-norm clipping and the MoE expert balance."""
