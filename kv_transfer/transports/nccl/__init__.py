"""The nccl KV transport (torch.distributed point-to-point; gloo on CPU): transport.py."""
