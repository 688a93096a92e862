"""The CPU KV store: swapped-out blocks in a shared-memory pool owned by a store (a Ray actor
beside Ray workers, or in the engine's process). store.py: the store and its layout (torch-free:
the coordinator imports it). swap_space.py: a worker's side, over shared memory (shm_transport.py)
or gRPC (grpc_transport.py)."""
