"""The ucx KV transport (ucxx): transport.py."""
