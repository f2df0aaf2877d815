"""One file per parallelism, each an apply_* function over explicit modules and meshes."""
