"""The same-host shared-memory KV transport: transport.py, and its staging ring's allocator (ring.py)."""
