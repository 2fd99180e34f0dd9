"""vLLM's external prefill/decode protocol between two pdcluster instances (wire/external_kv.py says what a
proxy sends): the prefill instance keeps a finished prompt's full blocks and serves them from a KV export
server (export_server.py); the decode instance pulls them (pull.py) on its offload loader thread before
the request's first step, and the engine takes them as a prefix-cache hit (engine/kv_offload/gate.py)."""
