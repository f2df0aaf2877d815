"""The data path: sources -> tokenizer -> token cache -> loader (memmap windows or streaming)."""
