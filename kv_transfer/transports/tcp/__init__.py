"""The tcp KV transport (pyzmq): transport.py."""
