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


def train(data_dir, out, processes: int) -> tuple[list[float], list[dict]]:
    """(logged losses, each process's final parameters) of a run over `processes` processes."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = [*(launcher if processes > 1 else [sys.executable]), os.path.join(REPO, "tests", "ddp_worker.py"),
               "--data_dir", data_dir, "--output_dir", str(out), "--use_cpu", "true", "--max_steps", str(STEPS),
               "--per_device_train_batch_size", str(GLOBAL_BATCH // processes), "--logging_steps", "1",
               "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false", "--max_eval_samples", "8",
               "--learning_rate", "3e-3", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
               "--disable_tqdm", "true"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # own group: a hung collective is ended whole
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    with open(out / "log_history.json") as f:
        losses = [entry["loss"] for entry in json.load(f) if "loss" in entry]
    replicas = [torch.load(out / f"replica-{rank}.pt") for rank in range(processes)]
    return losses, replicas


@pytest.fixture(scope="module")
def single(tiny_data_dir, tmp_path_factory):
    return train(tiny_data_dir, tmp_path_factory.mktemp("ddp-1"), 1)


@pytest.mark.parametrize("processes", [2, 4])
def test_replicas_stay_identical_and_match_one_process_on_the_global_batch(tiny_data_dir, tmp_path, single,
                                                                          processes):
    losses, replicas = train(tiny_data_dir, tmp_path, processes)
    reference_losses, (reference,) = single
    assert len(losses) == STEPS
    first = replicas[0]
    for other in replicas[1:]:  # bit-identical replicas: every process took the same updates
        assert other.keys() == first.keys()
        assert all(torch.equal(other[name], first[name]) for name in first)
    assert losses == pytest.approx(reference_losses, abs=1e-5)
    moved = max((first[name] - reference[name]).abs().max().item() for name in first)
    assert moved < 1e-5
