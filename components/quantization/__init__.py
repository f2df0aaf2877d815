"""Model converters (in-place rewrites before parallelizing) and float8 training through torchao."""
