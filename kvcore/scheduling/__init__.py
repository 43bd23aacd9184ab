"""Request lifecycle and KV memory (layer 2): requests, the block manager, the scheduler."""
