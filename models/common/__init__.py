"""Layers shared by the model families: RMSNorm, rotary embeddings, attention, feed-forward."""
