"""Training data: where documents come from (corpus), the tokenizer, packing, the token shard format (shards) and
the preparation that ties them together (prepare)."""
