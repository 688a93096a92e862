"""The CPU KV store: swapped-out blocks in a shared-memory pool owned by a store (a Ray actor
beside Ray workers, or in the engine's process). See store.py for the layout."""
