"""Workers: the model on paged attention, its KV cache, sampling, executors."""
