"""Request handling, KV cache, scheduling and model execution."""
