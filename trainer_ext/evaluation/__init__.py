"""Evaluation of causal LMs on held-out shards.

    metrics      held-out quality from full forward passes (CE, perplexity, top-1/top-5) and learning warnings
    generation   decoding: generation speed and the cost of the `shared` KV cache mode
    checkpoints  saved checkpoints across depths: EvaluateArguments, load_checkpoint, evaluate_checkpoints
    report       results.json / results.md (written and read there), markdown_table
    plots        PNG plots of depth results and learning curves
    next_token/  the `next_token` metric, an offline `evaluate` module
"""
