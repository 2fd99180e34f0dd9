"""The same-host cuda_ipc KV transport: transport.py, and the cache handle it shares (handle.py)."""
