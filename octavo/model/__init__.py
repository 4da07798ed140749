"""Models built from shared layers, their weight loaders and the architecture registry."""
