"""Host-owned context memory: the backbone's KV slot pool, the prefix cache, parked contexts."""
