"""The bottom layer that engine and kv_transfer both speak, so neither imports the other: typed records
and their codec (records.py), the token-logprobs record that rides in transfers and events
(logprobs.py), and the KV connector contract between an engine and a transfer (kv_connector.py)."""
