"""KV blocks beyond the device pool: a host-memory tier and a local-disk tier below it.

A block the device pool evicts moves down (device -> host -> disk) instead of vanishing, keyed by its
chained prefix hash (engine/block_manager.py ``chained_block_hashes``, stable across processes). A prompt
whose prefix continues in a lower tier gets those blocks loaded back into fresh device blocks, off the
step loop; a block that cannot be read back intact (missing file, bad checksum) is a miss, and the
tokens are recomputed: a lower tier never produces wrong KV."""
