import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaForCausalLM

from hf_recurrent import RecurrentDepthForCausalLM, presets
from trainer_ext.cli import evaluate_checkpoints as evaluate_script
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.evaluation.checkpoints import evaluate_checkpoints
from trainer_ext.evaluation.generation import cache_mode_cost, generation_speed
from trainer_ext.evaluation.metrics import (
    context_free_warning,
    depth_collapse_warning,
    evaluate_model,
    learning_warnings,
    load_metric,
    token_statistics,
    unigram_cross_entropy,
)
from trainer_ext.evaluation.report import read_report


@pytest.fixture(scope="module")
def eval_set(tiny_data_dir):
    return ShardedTokenDataset(tiny_data_dir, "eval")


@pytest.fixture(scope="module")
def checkpoints(tiny_data_dir, tmp_path_factory):
    """Randomly initialised debug checkpoints (recurrent and Llama baseline) saved with the data's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for name, preset, cls in (("ours", "debug", RecurrentDepthForCausalLM),
                              ("baseline", "transformer-debug", LlamaForCausalLM)):
        torch.manual_seed(0)
        model = cls(presets.get(preset, vocab_size=len(tokenizer)))
        path = root / name / "final"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


def _recurrent():
    torch.manual_seed(0)
    return RecurrentDepthForCausalLM(presets.get("debug", vocab_size=384)).eval()


def _naive(model, dataset, **kwargs):
    """CE and top-k from full logits of the whole split: the reference the chunked evaluation must match."""
    input_ids = torch.stack([dataset[i]["input_ids"] for i in range(len(dataset))])
    targets = torch.stack([dataset[i]["shift_labels"] for i in range(len(dataset))])
    with torch.no_grad():
        logits = model(input_ids, use_cache=False, **kwargs).logits.reshape(-1, model.config.vocab_size)
    targets = targets.reshape(-1)
    top5 = logits.topk(5, dim=-1).indices
    return {
        "ce": F.cross_entropy(logits, targets).item(),
        "top1": (top5[:, 0] == targets).float().mean().item(),
        "top5": (top5 == targets[:, None]).any(-1).float().mean().item(),
        "tokens": targets.numel(),
    }


# ----------------------------------------------------------------------------- metric module


def test_next_token_metric_matches_hand_computation():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 50, generator=generator) * 3
    targets = torch.randint(0, 50, (300,), generator=generator)
    metric = load_metric("next_token")
    for rows in torch.arange(300).split(128):  # several batches, as evaluation adds them
        nll, rank = token_statistics(logits[rows], targets[rows])
        metric.add_batch(nll=nll.numpy(), rank=rank.numpy())
    result = metric.compute()

    ce = F.cross_entropy(logits, targets).item()
    top = logits.topk(5, dim=-1).indices
    assert result["tokens"] == 300
    assert result["ce"] == pytest.approx(ce, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(ce), rel=1e-5)
    assert result["top1"] == pytest.approx((logits.argmax(-1) == targets).float().mean().item())
    assert result["top5"] == pytest.approx((top == targets[:, None]).any(-1).float().mean().item())
    assert 0 < result["top1"] < result["top5"] < 1


def test_next_token_metric_rejects_bad_input():
    metric = load_metric("next_token")
    metric.add_batch(nll=[float("nan")], rank=[0])
    with pytest.raises(ValueError, match="nll"):
        metric.compute()
    with pytest.raises(ValueError, match="no metric module"):
        load_metric("bleu")


# ----------------------------------------------------------------------------- evaluate_model


def test_evaluate_model_matches_naive_full_logits(eval_set):
    model = _recurrent()
    # Small batches and chunks, so positions cross batch and chunk boundaries.
    result = evaluate_model(model, eval_set, num_steps=3, batch_size=5, chunk_size=37, progress=False)
    naive = _naive(model, eval_set, num_steps=3)
    assert result["tokens"] == naive["tokens"] == len(eval_set) * eval_set.seq_len
    assert result["ce"] == pytest.approx(naive["ce"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(naive["ce"]), rel=1e-4)
    assert result["top1"] == pytest.approx(naive["top1"])
    assert result["top5"] == pytest.approx(naive["top5"])
    assert not model.training


def test_evaluate_model_depths_differ_and_max_batches_limits(eval_set):
    model = _recurrent()
    ces = [evaluate_model(model, eval_set, num_steps=n, batch_size=8, progress=False)["ce"] for n in (1, 3, 6)]
    assert len(set(ces)) == 3
    limited = evaluate_model(model, eval_set, num_steps=1, batch_size=4, max_batches=2, progress=False)
    assert limited["tokens"] == 2 * 4 * eval_set.seq_len


def test_evaluate_model_ignores_masked_targets(eval_set):
    model = _recurrent()

    class Masked(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            item = dict(eval_set[i])
            item["shift_labels"] = item["shift_labels"].clone()
            item["shift_labels"][:10] = -100
            return item

    result = evaluate_model(model, Masked(), num_steps=2, progress=False)
    assert result["tokens"] == 4 * (eval_set.seq_len - 10)


def test_evaluate_model_baseline_and_argument_errors(eval_set):
    torch.manual_seed(0)
    baseline = LlamaForCausalLM(presets.get("transformer-debug", vocab_size=384))
    result = evaluate_model(baseline, eval_set, batch_size=16, progress=False)
    assert result["ce"] == pytest.approx(_naive(baseline, eval_set)["ce"], rel=1e-5)
    with pytest.raises(ValueError, match="fixed depth"):
        evaluate_model(baseline, eval_set, num_steps=4, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate_model(baseline, eval_set, batch_size=0, progress=False)


# ----------------------------------------------------------------------------- speed, cache modes


def test_generation_speed_is_positive_per_batch_size():
    model = _recurrent()
    speeds = generation_speed(model, prompt_len=8, new_tokens=4, batch_sizes=(1, 3), num_steps=2)
    assert set(speeds) == {1, 3} and all(s > 0 for s in speeds.values())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generation_speed(model, prompt_len=500, new_tokens=100)


def test_generation_speed_gives_each_row_its_own_prompt_when_given_one_per_row(monkeypatch):
    model = _recurrent()
    prompts = torch.randint(4, 200, (3, 10), generator=torch.Generator().manual_seed(0))
    seen = []
    real_generate = type(model).generate

    def recorded(self, ids, **kwargs):
        seen.append(ids)
        return real_generate(self, ids, **kwargs)
    monkeypatch.setattr(type(model), "generate", recorded)
    generation_speed(model, prompt_len=8, new_tokens=2, batch_sizes=(3,), prompt_ids=prompts, repeats=1)
    assert all(torch.equal(ids, prompts[:, :8]) for ids in seen)  # warm-up and timed call: the rows as given
    with pytest.raises(ValueError, match="3 rows; give one, or one per row of the batch \\(2\\)"):
        generation_speed(model, prompt_len=8, new_tokens=2, batch_sizes=(2,), prompt_ids=prompts)


def test_cache_mode_cost_per_step_equals_full_forward(eval_set):
    model = _recurrent()
    cost = cache_mode_cost(model, eval_set, num_steps=4, max_samples=3, prefix_len=20, progress=False)
    assert cost["tokens"] == cost["per_step"]["tokens"] == cost["shared"]["tokens"] == 3 * (eval_set.seq_len - 20)
    assert cost["per_step"]["ce"] == pytest.approx(cost["full_forward"]["ce"], abs=1e-5)
    # At depth 4 the shared cache is an approximation: its CE differs from the exact one.
    assert abs(cost["shared_ce_increase"]) > 1e-6
    assert model.config.kv_cache_mode == "per_step"  # restored


def test_cache_mode_cost_shared_equals_per_step_at_depth_one(eval_set):
    model = _recurrent()
    cost = cache_mode_cost(model, eval_set, num_steps=1, max_samples=2, prefix_len=0, progress=False)
    assert cost["shared"]["ce"] == pytest.approx(cost["per_step"]["ce"], abs=1e-6)
    assert cost["per_step"]["ce"] == pytest.approx(cost["full_forward"]["ce"], abs=1e-5)
    with pytest.raises(ValueError, match="prefix_len"):
        cache_mode_cost(model, eval_set, num_steps=1, prefix_len=eval_set.seq_len, progress=False)


# ----------------------------------------------------------------------------- script


def test_evaluate_script_writes_json_and_markdown(tiny_data_dir, checkpoints, tmp_path):
    out = tmp_path / "eval"
    report = evaluate_checkpoints(evaluate_script.parse_args([
        "--checkpoints", checkpoints["ours"], checkpoints["baseline"], "--data_dir", tiny_data_dir,
        "--depths", "1", "3", "--max_samples", "8", "--speed_batch_size", "2", "--prompt_len", "8",
        "--new_tokens", "3", "--speed_repeats", "1", "--cache_cost_samples", "2", "--cache_cost_tokens", "4", "--output_dir", str(out),
        "--plots", "false"]))

    saved = read_report(str(out / "results.json"))
    assert saved["results"] == report["results"]
    columns = [(r["model"], r["num_steps"]) for r in saved["results"]]
    assert columns == [("ours", 1), ("ours", 3), ("baseline", None)]  # default labels: the run folders
    for record in saved["results"]:
        assert record["tokens"] == 8 * 32
        assert record["tokens_per_s_batch_1"] > 0 and record["tokens_per_s_batch_2"] > 0
    assert saved["results"][0]["ce"] != saved["results"][1]["ce"]
    assert [r["layers"] for r in saved["results"]] == [1 + 2 + 1, 1 + 3 * 2 + 1, 4]
    [cost] = saved["cache_mode_cost"]
    assert cost["model"] == "ours" and cost["num_steps"] == 4 and cost["tokens"] == 2 * 4

    table = (out / "results.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == ["metric", "ours / n=1", "ours / n=3", "baseline / 4 layers"]
    rows = [line.strip("|").split("|")[0].strip() for line in lines[1:7]]
    assert rows == ["CE", "perplexity", "top-1", "top-5", "tokens/s (batch 1)", "tokens/s (batch 2)"]
    assert f"{saved['results'][0]['ce']:.4f}" in lines[1]
    assert "shared - per_step" in table


def test_depth_collapse_warning_thresholds():
    assert depth_collapse_warning("m", {1: 4.50, 4: 4.48}) is None  # depth matters: healthy
    assert depth_collapse_warning("m", {3: 7.1653}) is None  # one depth: nothing to compare
    warning = depth_collapse_warning("m", {1: 7.1658, 3: 7.1653, 24: 7.1653})
    assert warning.startswith("m: held-out CE is the same at depth 1 and depth 24")


def test_unigram_cross_entropy_is_the_entropy_of_the_target_frequencies(eval_set):
    items = [{"shift_labels": torch.tensor([5, 5, 7, -100])}, {"shift_labels": torch.tensor([9, 5, -100, -100])}]
    p = torch.tensor([3, 1, 1], dtype=torch.float64) / 5  # token 5 three times, 7 and 9 once; -100 ignored
    assert unigram_cross_entropy(items) == pytest.approx(float(-(p * p.log()).sum()))
    # On real shards: no context-free predictor beats it, e.g. the frequencies themselves scored as a model.
    targets = torch.cat([eval_set[i]["shift_labels"] for i in range(len(eval_set))])
    targets = targets[targets != -100]
    log_freq = torch.bincount(targets).double().div(len(targets)).log()
    assert unigram_cross_entropy(eval_set) == pytest.approx(float(-log_freq[targets].mean()))
    with pytest.raises(ValueError, match="no target tokens"):
        unigram_cross_entropy([{"shift_labels": torch.tensor([-100, -100])}])


def test_context_free_and_depth_warnings():
    assert context_free_warning("m", ce=4.9, unigram_ce=6.4) is None  # learned from the context
    assert "frequency alone" in context_free_warning("m", ce=7.3, unigram_ce=6.4)  # the collapsed 125M run
    assert context_free_warning("m", ce=6.3, unigram_ce=6.4) is not None  # within the margin
    # A Transformer (one depth) is only checked against the frequencies; a recurrent model also across depths.
    assert learning_warnings("t", {None: 4.9}, 6.4) == []
    assert len(learning_warnings("r", {1: 7.3165, 24: 7.3165}, 6.4)) == 2
    assert learning_warnings("r", {1: 5.0, 6: 4.9}, None) == []


def test_evaluate_script_warns_about_a_collapsed_recurrent_model(tiny_data_dir, tmp_path, caplog):
    """A core that writes nothing and an adapter that ignores the state: every depth gives the same output."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(presets.get("debug", vocab_size=len(tokenizer)))
    hidden = model.config.hidden_size
    with torch.no_grad():
        model.model.adapter.weight[:, :hidden] = 0  # the state half of the [state, embedded] input
        for layer in model.model.core:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(tmp_path / "collapsed")
    tokenizer.save_pretrained(tmp_path / "collapsed")
    args = ["--data_dir", tiny_data_dir, "--depths", "1", "4", "--max_samples", "4", "--speed_batch_size", "1",
            "--prompt_len", "8", "--new_tokens", "2", "--speed_repeats", "1", "--cache_cost_samples", "0",
            "--plots", "false", "--output_dir", str(tmp_path / "eval")]
    with caplog.at_level("WARNING"):
        report = evaluate_checkpoints(evaluate_script.parse_args(
            ["--checkpoints", str(tmp_path / "collapsed"), *args]))
    ce = [r["ce"] for r in report["results"]]
    assert ce[0] == pytest.approx(ce[1], abs=1e-6)
    assert "the recurrent state has probably collapsed" in caplog.text
    # An untrained model is also no better than the token frequencies of the four evaluated samples.
    heldout = ShardedTokenDataset(tiny_data_dir, "eval")
    frequency_only = unigram_cross_entropy([heldout[i] for i in range(4)])
    assert report["data"]["frequency_only_ce"] == pytest.approx(frequency_only)
    assert "no better than predicting every token from its frequency" in caplog.text
    assert f"{frequency_only:.4f}" in (tmp_path / "eval" / "results.md").read_text()


def test_evaluate_script_rejects_bad_arguments(tiny_data_dir, checkpoints, tmp_path):
    with pytest.raises(ValueError, match="--labels"):
        evaluate_script.main(["--checkpoints", checkpoints["ours"], "--labels", "a", "b",
                              "--data_dir", tiny_data_dir])
    with pytest.raises(ValueError, match="config.json"):
        evaluate_script.main(["--checkpoints", str(tmp_path), "--data_dir", tiny_data_dir, "--plots", "false",
                              "--output_dir", str(tmp_path / "out")])


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from trainer_ext.evaluation.plots import plot_depth_curves, plot_learning_curves

    results = [
        {"model": "ours", "kind": "recurrent", "num_steps": n, "layers": 2 + 2 * n, "ce": 4 - 0.1 * n,
         "top1": 0.1 * n, "top5": 0.2 * n, "tokens_per_s_batch_1": 100 / n, "tokens_per_s_batch_8": 600 / n}
        for n in (1, 3, 6)
    ] + [{"model": "baseline", "kind": "transformer", "num_steps": None, "layers": 8, "ce": 3.7, "top1": 0.3,
          "top5": 0.5, "tokens_per_s_batch_1": 50.0, "tokens_per_s_batch_8": 300.0}]
    paths = plot_depth_curves(results, str(tmp_path))
    records = [{"model": m, "cycle": c, "tokens_seen": c * 1000, "ce": 5 - c - (m == "ours"), "top1": 0.1 * c}
               for m in ("ours", "baseline") for c in (1, 2, 3)]
    paths.append(plot_learning_curves(records, str(tmp_path / "curves" / "learning.png")))
    assert [os.path.basename(p) for p in paths] == ["quality_vs_depth.png", "speed_vs_depth.png", "learning.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["curves", "quality_vs_depth.png", "speed_vs_depth.png"]  # no temp files
    with pytest.raises(ValueError, match="tokens_seen"):
        plot_learning_curves([{"model": "ours", "cycle": 1, "ce": 3.0}], str(tmp_path / "x.png"))
