"""Early exits that skip compute in a batch: a core step runs only on the rows still iterating, cut after their last
iterating token, and gives what the masked step gives (logits, steps used, cache contents) up to the kernels'
rounding on a block of another shape; batches with left padding and exits decode as each row alone."""

import pytest
import torch

from hf_recurrent import RecurrentDepthForCausalLM, adaptive_depth, presets
from hf_recurrent.modeling_recurrent_depth import CACHE_FIELD

# A threshold at which the debug model's tokens exit after different numbers of steps (5 to 12 at n = 12).
MIXED = 0.3
CLOSE = dict(atol=1e-5, rtol=1e-5)


def tiny(attn="sdpa", **overrides) -> RecurrentDepthForCausalLM:
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(presets.get("debug", **overrides)).eval()
    model.config._attn_implementation = attn
    return model


def left_padded(lengths=(10, 7, 10, 4), seq=10, seed=1):
    """Token ids (B, seq) whose row b holds lengths[b] tokens after left padding, and the attention mask."""
    ids = torch.randint(3, 500, (len(lengths), seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :seq - length] = 0
        mask[row, seq - length:] = 1
    return ids, mask


class CoreTokens:
    """Counts the tokens (rows x positions) through the first core layer inside a `with` block."""

    def __init__(self, model):
        self.layer, self.tokens = model.model.core[0], 0

    def __enter__(self):
        self.handle = self.layer.register_forward_pre_hook(self.count)
        return self

    def count(self, module, args):
        self.tokens += args[0].shape[0] * args[0].shape[1]

    def __exit__(self, *_):
        self.handle.remove()


def compacted_and_masked(model, monkeypatch, call):
    """`call()` under `no_grad` with exited tokens left out of later steps, then masked: [(result, core tokens)].
    Blocks are cut right after their last iterating token (no rounding of the cut), as these sequences are short."""
    monkeypatch.setattr(adaptive_depth, "BLOCK_LENGTH_MULTIPLE", 1)
    runs = []
    for compact in (True, False):
        monkeypatch.setattr(adaptive_depth, "COMPACT_EXITED_STEPS", compact)
        with CoreTokens(model) as counter, torch.no_grad():
            result = call()
        runs.append((result, counter.tokens))
    return runs


def assert_same_cache(a, b):
    for slot_a, slot_b in zip(a.layers, b.layers, strict=True):
        torch.testing.assert_close(slot_a.keys, slot_b.keys, **CLOSE)
        torch.testing.assert_close(slot_a.values, slot_b.values, **CLOSE)


@pytest.mark.parametrize("attn, padded", [("sdpa", True), ("eager", True), ("sdpa", False)])
@pytest.mark.parametrize("threshold", [MIXED, 0.5])
def test_a_full_forward_runs_later_steps_on_the_rows_still_iterating_and_equals_the_masked_one(
        attn, padded, threshold, monkeypatch):
    model = tiny(attn)
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask) if padded else {}
    (compacted, compacted_tokens), (masked, masked_tokens) = compacted_and_masked(model, monkeypatch, lambda: model(
        ids, num_steps=12, use_cache=False, exit_threshold=threshold, output_hidden_states=True, **kwargs))
    assert torch.equal(compacted.num_steps_used, masked.num_steps_used)
    assert len(compacted.num_steps_used.unique()) > 1
    torch.testing.assert_close(compacted.logits, masked.logits, **CLOSE)
    for a, b in zip(compacted.hidden_states, masked.hidden_states, strict=True):
        torch.testing.assert_close(a, b, **CLOSE)
    # Masked: every token at every step until the last token of the batch exits.
    assert masked_tokens == ids.numel() * int(masked.num_steps_used.max())
    assert compacted_tokens < 0.9 * masked_tokens


def decode(model, ids, mask, prefix_len, threshold=MIXED, criterion="state"):
    """Prefill `ids[:, :prefix_len]`, then one token per row at a time: (logits, steps used, cache)."""
    exits = dict(num_steps=12, exit_threshold=threshold, exit_criterion=criterion)
    out = model(ids[:, :prefix_len], attention_mask=mask[:, :prefix_len], use_cache=True, **exits)
    cache, used, logits = getattr(out, CACHE_FIELD), [out.num_steps_used], [out.logits]
    for i in range(prefix_len, ids.shape[1]):
        out = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], **exits, **{CACHE_FIELD: cache})
        logits.append(out.logits)
        used.append(out.num_steps_used)
    return torch.cat(logits, dim=1), torch.cat(used, dim=1), cache


@pytest.mark.parametrize("mode", ["shared", "per_step"])
def test_batched_decoding_with_left_padding_runs_exited_rows_only_where_exact(mode, monkeypatch):
    model = tiny(kv_cache_mode=mode)
    ids, mask = left_padded((14, 11, 14, 6), seq=14)
    (compacted, compacted_tokens), (masked, masked_tokens) = compacted_and_masked(
        model, monkeypatch, lambda: decode(model, ids, mask, 8))
    assert torch.equal(compacted[1], masked[1]) and len(compacted[1][:, 8:].unique()) > 1
    torch.testing.assert_close(compacted[0], masked[0], **CLOSE)
    assert_same_cache(compacted[2], masked[2])  # the slots every step reads, written alike
    if mode == "shared":  # the steps before the last only read the cache: exited rows sit them out
        assert compacted_tokens < 0.9 * masked_tokens
    else:  # each step's slot needs every row's keys and values at that step: nothing to leave out
        assert compacted_tokens == masked_tokens
        assert torch.equal(compacted[0], masked[0])


@pytest.mark.parametrize("mode", ["shared", "per_step"])
def test_batched_generate_with_left_padding_and_exits_gives_each_rows_tokens_alone(mode):
    model = tiny(kv_cache_mode=mode)
    lengths = (9, 6, 4)
    ids, mask = left_padded(lengths, seq=9)
    greedy = dict(num_steps=12, exit_threshold=MIXED, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    batched = model.generate(ids, attention_mask=mask, **greedy)
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **greedy)  # masked exits
    assert torch.equal(batched.sequences, static.sequences)
    for row, length in enumerate(lengths):
        alone = model.generate(ids[row:row + 1, 9 - length:], **greedy)
        assert torch.equal(batched.sequences[row, 9:], alone.sequences[0, length:])
        for a, b in zip(batched.logits, alone.logits, strict=True):
            torch.testing.assert_close(a[row], b[0], **CLOSE)


def test_the_block_of_a_step_covers_the_rows_still_iterating_up_to_their_last_active_token(monkeypatch):
    monkeypatch.setattr(adaptive_depth, "BLOCK_LENGTH_MULTIPLE", 1)
    depth_exit = adaptive_depth.DepthExit(0.1, (3, 5), torch.device("cpu"), compact=True)
    depth_exit.active = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    rows, length = depth_exit._needed_block()
    assert rows.tolist() == [0, 2] and length == 4
    depth_exit.active[2] = False
    assert depth_exit._needed_block()[1] == 3
    # the cut rounded up to a multiple of positions, at most the sequence: a bounded set of block shapes
    monkeypatch.setattr(adaptive_depth, "BLOCK_LENGTH_MULTIPLE", 2)
    assert depth_exit._needed_block()[1] == 4
    monkeypatch.setattr(adaptive_depth, "BLOCK_LENGTH_MULTIPLE", 4)
    assert depth_exit._needed_block()[1] == 4 and adaptive_depth.block_length(5, 5) == 5
    assert [adaptive_depth.block_length(end, 1024) for end in (1, 4, 5, 1021)] == [4, 4, 8, 1024]
    monkeypatch.setattr(adaptive_depth, "BLOCK_LENGTH_MULTIPLE", 1)
    depth_exit.active[0, 4] = True  # a row's last token iterates: every position is needed
    rows, length = depth_exit._needed_block()
    assert rows.tolist() == [0] and length == 5
    depth_exit.compact = False  # a static cache: the whole batch while any token iterates
    assert depth_exit._needed_block() == (None, 5)
    depth_exit.active[:] = False
    assert depth_exit._needed_block() is None
    with torch.no_grad():  # the step after every token has exited: left out (no cache), no block
        steps = depth_exit.steps(4, None, None)
        assert list(steps) == [0] and depth_exit.block is None


@pytest.mark.parametrize("multiple", [1, 4])
def test_the_exit_compute_benchmark_counts_what_the_core_runs(multiple, monkeypatch):
    from benchmarks.exit_compute import shares

    monkeypatch.setattr(adaptive_depth, "BLOCK_LENGTH_MULTIPLE", multiple)  # blocks cut to multiples of positions

    # By hand: 2 rows of 2 tokens at n = 3 (fixed: 12 token-steps). Step 1 runs all 4 (windows 2 + 2); step 2 the
    # second token of row 0 and the first of row 1 (both rows, cut after position 1: 4; windows 1 + 1); step 3 row
    # 0's second token (one row of 2; window 1).
    if multiple == 1:
        assert shares(torch.tensor([[1, 3], [2, 1]]), 3) == {"token": 7 / 12, "window": 7 / 12, "run": 10 / 12}
    model = tiny()
    ids, _ = left_padded((10, 10, 10, 10))
    with CoreTokens(model) as counter, torch.no_grad():
        out = model(ids, num_steps=12, use_cache=False, exit_threshold=MIXED)
    found = shares(out.num_steps_used, 12)
    assert counter.tokens == round(found["run"] * ids.numel() * 12)
    assert found["token"] <= found["window"] <= found["run"] < 1


def test_the_exit_compute_benchmark_times_the_forward_with_each_rounding_and_restores_the_default():
    from argparse import Namespace

    from benchmarks.exit_compute import forward_speedups
    from trainer_ext.evaluation.generation import forward_speed

    defaults = adaptive_depth.BLOCK_LENGTH_MULTIPLE, adaptive_depth.BLOCK_SDPA_BACKENDS
    model = tiny()
    ids, _ = left_padded((10, 10, 10, 10))
    data = [{"input_ids": row, "shift_labels": row} for row in ids]
    args = Namespace(num_steps=12, batch_size=2, samples=4, speed_rounds=2, thresholds=[MIXED, 1e9],
                     block_multiples=[1, 4], block_sdpa=["no_cudnn", "torch"])
    rows = forward_speedups(model, data, args)
    assert [(r["threshold"], r["block_multiple"], r["block_sdpa"]) for r in rows] == [
        (threshold, multiple, sdpa)
        for multiple in (1, 4) for sdpa in ("no_cudnn", "torch") for threshold in (MIXED, 1e9)]
    for row in rows:
        assert len(row["forward_speedups"]) == 2 and row["forward_speedup"] > 0
    assert (adaptive_depth.BLOCK_LENGTH_MULTIPLE, adaptive_depth.BLOCK_SDPA_BACKENDS) == defaults
    assert defaults[0] == 1 and defaults[1] is not None  # the defaults the variants were timed against
    with pytest.raises(ValueError, match="batches=0"):
        forward_speed(model, data, num_steps=12, batches=0)


def test_a_step_on_a_block_keeps_cudnn_attention_out_and_a_full_step_keeps_torchs_choice(monkeypatch):
    monkeypatch.setattr(adaptive_depth, "BLOCK_LENGTH_MULTIPLE", 1)
    model = tiny()
    ids, _ = left_padded((10, 10, 10, 10))
    seen = []  # per core-layer call: (tokens it runs on, whether SDPA may pick cuDNN's attention)
    hook = model.model.core[0].register_forward_pre_hook(
        lambda module, args: seen.append((args[0].shape[:2].numel(), torch.backends.cuda.cudnn_sdp_enabled())))
    with torch.no_grad():
        model(ids, num_steps=12, use_cache=False, exit_threshold=MIXED)
    hook.remove()
    assert {enabled for tokens, enabled in seen if tokens == ids.numel()} == {True}  # full steps: torch's own
    assert {enabled for tokens, enabled in seen if tokens < ids.numel()} == {False}  # blocks: no cuDNN graphs
    assert torch.backends.cuda.cudnn_sdp_enabled()
