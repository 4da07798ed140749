"""Workers own a device, the model, its KV cache and the hot path."""
