"""Data parallelism with the in-backward optimizer on CPU (gloo): 2 and 4 processes train the debug preset on the same
global batch as one process. Each update must see the gradient averaged over the processes: every replica ends
bit-identical, and the losses and weights match the single process."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 8
STEPS = 4
TIMEOUT_S = 300


def train(data_dir, out, processes: int, *extra) -> tuple[list[dict], list[dict]]:
    """(logged loss entries, each process's final parameters) of a run over `processes` processes."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = [*(launcher if processes > 1 else [sys.executable]), os.path.join(REPO, "tests", "ddp_worker.py"),
               "--data_dir", data_dir, "--output_dir", str(out), "--use_cpu", "true", "--max_steps", str(STEPS),
               "--per_device_train_batch_size", str(GLOBAL_BATCH // processes), "--logging_steps", "1",
               "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false", "--max_eval_samples", "8",
               "--learning_rate", "3e-3", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
               "--disable_tqdm", "true", *extra]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # own group: a hung collective is ended whole
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    with open(out / "log_history.json") as f:
        logged = [entry for entry in json.load(f) if "loss" in entry]
    replicas = [torch.load(out / f"replica-{rank}.pt") for rank in range(processes)]
    return logged, replicas


@pytest.fixture(scope="module")
def single(tiny_data_dir, tmp_path_factory):
    return train(tiny_data_dir, tmp_path_factory.mktemp("ddp-1"), 1)


@pytest.mark.parametrize("processes", [2, 4])
def test_replicas_stay_identical_and_match_one_process_on_the_global_batch(tiny_data_dir, tmp_path, single,
                                                                          processes):
    logged, replicas = train(tiny_data_dir, tmp_path, processes)
    reference_logged, (reference,) = single
    assert len(logged) == STEPS
    assert_identical(replicas)
    assert [e["loss"] for e in logged] == pytest.approx([e["loss"] for e in reference_logged], abs=1e-5)
    moved = max((replicas[0][name] - reference[name]).abs().max().item() for name in reference)
    assert moved < 1e-5


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
