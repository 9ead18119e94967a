"""The KV cache's bookkeeping and its movement, one family: `cache/` (block pool, block tables,
prefix cache and its index: no tensors) and `transfer/` (moving blocks between instances for
P/D disaggregation: holds, pulls, the TCP wire, the secret, signing, TLS)."""
