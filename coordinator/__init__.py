"""The coordinator: scheduler, block allocator (block pool + KV cache manager), engine loop."""
