"""Data parallelism with the in-backward optimizer on CPU (gloo): 2 and 4 processes train the debug preset on the same
global batch as one process. Each update must see the gradient averaged over the processes: every replica ends
bit-identical, and the losses and weights match the single process.

Files that every process reads are written by one of them while the others wait: the comparison's data pieces,
teacher cache, state and results; the data preparation and teacher cache commands started by torchrun."""

import itertools
import json
import os

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from hf_recurrent import presets
from launcher import REPO, launch
from trainer_ext.data import corpus
from trainer_ext.files import launch_process_group, one_process_writes

GLOBAL_BATCH = 8
STEPS = 4


def train(data_dir, out, processes: int, *extra) -> tuple[list[dict], list[dict]]:
    """(logged loss entries, each process's final parameters) of a run over `processes` processes."""
    proc = launch(os.path.join(REPO, "tests", "ddp_worker.py"), processes,
                  "--data_dir", data_dir, "--output_dir", str(out), "--use_cpu", "true", "--max_steps", str(STEPS),
                  "--per_device_train_batch_size", str(GLOBAL_BATCH // processes), "--logging_steps", "1",
                  "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false", "--max_eval_samples", "8",
                  "--learning_rate", "3e-3", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
                  "--disable_tqdm", "true", *extra)
    assert proc.returncode == 0, proc.stdout[-4000:]
    with open(out / "log_history.json") as f:
        logged = [entry for entry in json.load(f) if "loss" in entry]
    replicas = [torch.load(out / f"replica-{rank}.pt") for rank in range(processes)]
    return logged, replicas


@pytest.fixture(scope="module")
def single(tiny_data_dir, tmp_path_factory):
    return train(tiny_data_dir, tmp_path_factory.mktemp("ddp-1"), 1)


def assert_matches_one_process(logged: list[dict], replicas: list[dict], single) -> None:
    """Identical replicas whose losses and weights are one process's on the same global batch."""
    reference_logged, (reference,) = single
    assert_identical(replicas)
    assert [e["loss"] for e in logged] == pytest.approx([e["loss"] for e in reference_logged], abs=1e-5)
    moved = max((replicas[0][name] - reference[name]).abs().max().item() for name in reference)
    assert moved < 1e-5


def test_replicas_stay_identical_and_match_one_process_on_the_global_batch(tiny_data_dir, tmp_path, single):
    """4 processes (2 processes: the next test, a run stopped and resumed), their layers placed as a memory plan places
    them on a GPU (a layer recomputed, a core step recomputed selectively, a layer kept): replicas and losses of one
    process, which recomputes every layer, and the kept layer's MLP runs once a step on every process."""
    logged, replicas = train(tiny_data_dir, tmp_path, 4, "--placement_mixed")
    assert len(logged) == STEPS
    assert_matches_one_process(logged, replicas, single)
    for rank in range(4):
        assert json.loads((tmp_path / f"coda-calls-{rank}.json").read_text()) == STEPS


def test_a_run_stopped_at_a_checkpoint_resumes_the_losses_on_every_process(tiny_data_dir, tmp_path, single):
    """2 processes stopped after step 2 (its checkpoint: weights, the optimizer's state and counters, each process's
    RNG) and rerun to step 4: both runs log the losses of one process on the global batch, the rerun resumes at the
    checkpoint, and the replicas stay identical and end with the one process's weights."""
    save = ["--save_strategy", "steps", "--save_steps", "2"]
    stopped, stopped_replicas = train(tiny_data_dir, tmp_path, 2, *save, "--max_steps", "2")
    assert [e["step"] for e in stopped] == [1, 2] and (tmp_path / "checkpoint-2").is_dir()
    assert [e["loss"] for e in stopped] == pytest.approx([e["loss"] for e in single[0][:2]], abs=1e-5)
    assert_identical(stopped_replicas)
    logged, replicas = train(tiny_data_dir, tmp_path, 2, *save)
    assert [e["step"] for e in logged] == [1, 2, 3, 4]  # the checkpoint's history, then the resumed steps
    assert_matches_one_process(logged, replicas, single)


def assert_identical(replicas: list[dict]) -> None:
    """Bit-identical replicas: every process took the same updates."""
    first = replicas[0]
    for other in replicas[1:]:
        assert other.keys() == first.keys()
        assert all(torch.equal(other[name], first[name]) for name in first)


def test_the_stability_guard_skips_the_same_steps_on_every_process(tiny_data_dir, tmp_path):
    """A learning rate that breaks the run, and a guard that skips every rise: the guard decides on the loss averaged
    over the processes, so all skip together (a skipped step runs no update, with DDP's all-reduce still in step)
    and the run follows one process on the same global batch."""
    guard = ["--learning_rate", "3e-1", "--stability_warmup_steps", "2", "--stability_loss_spike", "0.0001",
             "--stability_loss_spike_sigmas", "0"]
    reference, _ = train(tiny_data_dir, tmp_path / "one", 1, *guard)
    logged, replicas = train(tiny_data_dir, tmp_path / "two", 2, *guard)
    skipped = [e["stability/skipped_steps"] for e in logged]
    assert skipped == [e["stability/skipped_steps"] for e in reference] and skipped[-1] >= 1
    assert_identical(replicas)
    assert [e["loss"] for e in logged] == pytest.approx([e["loss"] for e in reference], rel=1e-4)


# ----------------------------------------------------------------------------- one process writes, the others wait


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """A --files corpus: 60 KJV chapters as JSONL."""
    path = tmp_path_factory.mktemp("files") / "chapters.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for chapter in itertools.islice(corpus.iter_default_documents(), 60):
            f.write(json.dumps({"text": chapter}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def teacher(tiny_data_dir, tmp_path_factory):
    """A tiny Llama teacher with the tiny corpus's tokenizer, initialised apart from the students (seed 0)."""
    path = str(tmp_path_factory.mktemp("teacher"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    torch.manual_seed(1)
    LlamaForCausalLM(presets.get("transformer-debug", vocab_size=len(tokenizer))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_without_a_launcher_the_one_writer_is_this_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    initialized = torch.distributed.is_initialized()
    with launch_process_group(), one_process_writes("nothing") as writes:
        assert writes
    assert torch.distributed.is_initialized() == initialized  # no group formed, none ended


def test_the_waiting_processes_stop_when_the_writer_fails(tmp_path):
    """Process 0 fails inside the block: process 1 raises instead of going on to read, and never enters the block.
    (Process 0 waits before it exits, so that the launcher does not end process 1 before it reports.)"""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import time, torch.distributed as dist\n"
        "from trainer_ext.files import one_process_writes\n"
        "dist.init_process_group('gloo')\n"
        "try:\n"
        "    with one_process_writes('the data') as writes:\n"
        "        print(f'rank {dist.get_rank()} entered, writes={writes}', flush=True)\n"
        "        raise ValueError('bad data')\n"
        "except Exception as error:\n"
        "    print(f'rank {dist.get_rank()}: {type(error).__name__}: {error}', flush=True)\n"
        "    time.sleep(3 if dist.get_rank() == 0 else 0)\n")
    output = launch(str(worker), 2).stdout
    assert "rank 0 entered, writes=True" in output and "rank 0: ValueError: bad data" in output
    assert "rank 1 entered" not in output
    assert "rank 1: RuntimeError: Process 0 failed while writing the data" in output


def test_the_data_and_cache_commands_under_torchrun_write_once(documents, teacher, tmp_path):
    """hf-recurrent-prepare-data --files and hf-recurrent-cache-teacher started by torchrun on a fresh folder: one
    process prepares (caches) while the other waits; both exit 0."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    prepared = launch(os.path.join(REPO, "scripts", "prepare_data.py"), 2, "--files", documents, "--output_dir",
                      str(data), "--tokenizer", teacher, "--seq_len", "32", "--eval_samples", "8", "--disable_tqdm",
                      "true")
    assert prepared.returncode == 0, prepared.stdout[-4000:]
    assert prepared.stdout.count(f"Wrote {data}:") == 1
    cached = launch(os.path.join(REPO, "scripts", "cache_teacher.py"), 2, "--teacher_model_name_or_path", teacher,
                    "--data_dir", str(data), "--output_dir", str(cache), "--topk", "8", "--device", "cpu")
    assert cached.returncode == 0, cached.stdout[-4000:]
    assert cached.stdout.count("Caching top-8") == 1
    for folder in (data, cache):
        assert not list(folder.glob(".*.tmp"))
    assert (cache / "teacher_manifest.json").is_file()


def test_the_comparison_on_two_processes_prepares_and_caches_once_and_trains_on_both(documents, teacher, tmp_path):
    """hf-recurrent-compare --files --teacher_cache_model under torchrun on a fresh folder: the held-out set, the
    cycle's shards and its teacher cache are written once, both models train data-parallel on a global batch of
    2 processes x 2 samples (one pass over the cycle's 8 samples in 2 steps), both processes exit 0."""
    out = tmp_path / "run"
    proc = launch(os.path.join(REPO, "scripts", "compare.py"), 2,
                  "--output_dir", str(out), "--files", documents, "--use_cpu", "true", "--num_cycles", "1",
                  "--cycle_tokens", "256", "--per_device_train_batch_size", "2", "--seq_len", "32",
                  "--eval_tokens", "264", "--eval_depths", "1", "--warmup_steps", "0", "--learning_rate", "3e-3",
                  "--logging_steps", "1", "--tokenizer", teacher, "--teacher_cache_model", teacher,
                  "--teacher_cache_topk", "8", "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for piece in ("heldout", "cycle-001"):
        assert proc.stdout.count(f"Wrote {out / 'data' / piece}:") == 1
    assert proc.stdout.count("Caching top-8") == 1
    state = json.loads((out / "compare_state.json").read_text())
    assert state["identity"]["compare"]["num_processes"] == 2
    cycle = state["cycles"]["1"]
    assert cycle["prepare"]["train_samples"] == 8 and list(cycle) == ["prepare", "cache_teacher", "train_recurrent",
                                                                      "train_baseline", "evaluate", "cleanup"]
    for model in ("recurrent", "baseline"):
        assert cycle[f"train_{model}"]["steps"] == 2
        steps = [e for e in json.loads((out / model / "cycle-001" / "log_history.json").read_text()) if "loss" in e]
        assert [e["epoch"] for e in steps] == [0.5, 1.0] and all(e["kd"] > 0 for e in steps)
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
    assert sorted(os.listdir(out / "data")) == ["heldout"]
