"""The CPU KV store (swapped-out blocks over shared memory or gRPC): arrives with the KV-store issue."""
