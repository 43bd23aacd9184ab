"""Request lifecycle and KV memory: requests, the block manager, the scheduler."""
