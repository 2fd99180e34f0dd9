"""The KV connectors, one module per role, both behind the contract in wire/kv_connector.py: the
producer (prefill.py) sends the blocks of the prompts it computes as they become final; the consumer
(decode.py) tracks the transfers into its reserved blocks and tells its engine which have landed or
failed."""
