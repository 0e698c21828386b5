"""Training data: where documents come from (corpus; JSON files record by record in json_records), the tokenizer,
packing, the token shard format (shards) and the preparation that ties them together (prepare)."""
