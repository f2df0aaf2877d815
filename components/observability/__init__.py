"""What a run tells: console and metrics.jsonl, TensorBoard and W&B, MFU, memory and profiles."""
