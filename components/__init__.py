"""Independent building blocks of Kiln: config, data, tokenizer, checkpointing, optimizers, metrics."""
