"""What the prefill and decode workers share: the engine thread (worker_loop), the typed events a
worker sends the router (events) and their pusher, the Ray actor base (actor), the control-plane
endpoint configuration (endpoint), and the connector of vLLM's external prefill/decode split (external_kv)."""
