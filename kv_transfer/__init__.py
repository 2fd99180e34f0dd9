"""KV transfer: the connector between an engine and the other workers (connector/), the control plane that pairs a
decode worker's blocks with a prefill worker's sends (control_plane/), the transports that move the bytes
(transports/: tcp, shm, ucx, nccl, cuda_ipc), and the pull of vLLM's external prefill/decode split between two
instances (external/)."""
