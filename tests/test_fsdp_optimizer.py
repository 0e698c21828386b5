"""FSDP2 with the low-memory optimizer inside backward, on CPU: 2 and 4 gloo processes (tests/fsdp_optimizer_worker.py)
train the debug model sharded by `fully_shard`, with dimensions the process counts do not divide, and must match
the unsharded optimizer on one process on the same global batch; a run stopped after a distributed checkpoint and
resumed (on the same or another number of processes) must reproduce the uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fsdp_optimizer_worker as worker
from launcher import REPO, TIMEOUT_S, launch

STEPS = 4


def run_worker(out, nproc: int, momenta: tuple[str, ...], *args: str) -> dict[str, tuple[list, dict]]:
    """Per momentum mode: (logged steps, whole weights at the end) of the worker on `nproc` processes."""
    os.makedirs(out, exist_ok=True)
    proc = launch(os.path.join(REPO, "tests", "fsdp_optimizer_worker.py"), nproc, "--out", out, "--steps", STEPS,
                  "--momentum", *momenta, *args)
    assert proc.returncode == 0, f"worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}"
    runs = {}
    for momentum in momenta:
        with open(os.path.join(out, f"losses-{momentum}.json")) as f:
            runs[momentum] = json.load(f), torch.load(os.path.join(out, f"weights-{momentum}.pt"))
    return runs


MOMENTA = ("none", "full", "subspace")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, whole tensors, every momentum mode: {mode: (losses, weights)}; and the Trainer's path."""
    return {"worker": run_worker(tmp_path_factory.mktemp("single"), 1, MOMENTA),
            "trainer": run_worker(tmp_path_factory.mktemp("single-trainer"), 1, ("subspace",), "--trainer_path")}


def assert_same_run(sharded, reference):
    (losses, weights), (ref_losses, ref_weights) = sharded, reference
    assert [h["step"] for h in losses] == [h["step"] for h in ref_losses]
    for key in ("loss", "grad_norm"):  # the gradient norm is summed over the shards
        torch.testing.assert_close(torch.tensor([h[key] for h in losses]), torch.tensor([h[key] for h in ref_losses]),
                                   rtol=1e-5, atol=1e-6)
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=1e-5, msg=name)


def test_sharded_update_equals_unsharded(tmp_path, single):
    """2 processes, every momentum mode (4 processes: the run stopped and resumed on 2, below)."""
    sharded = run_worker(tmp_path, 2, MOMENTA)
    for momentum in MOMENTA:
        reference = single["worker"][momentum]
        assert reference[0][-1]["loss"] < reference[0][0]["loss"] + 0.1  # it trains, not diverges
        assert_same_run(sharded[momentum], reference)


def test_trainer_order_and_loss_under_fsdp2(tmp_path, single):
    """The optimizer built before the sharding and bound after it (RecurrentTrainer under accelerate), the loss
    through the wrapped root: the same run as one process."""
    sharded = run_worker(tmp_path, 2, ("subspace",), "--trainer_path")
    assert_same_run(sharded["subspace"], single["trainer"]["subspace"])


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_memory_plans_placements_under_fsdp2_train_as_one_process_keeping_everything(tmp_path, single, nproc):
    """Layers recomputed and recomputed selectively (the default plan's placements on a GPU) on sharded layers: the
    losses, gradient norms and weights of one process that keeps every activation."""
    placed = run_worker(tmp_path, nproc, ("subspace",), "--placement", "mixed")
    assert [h["prelude_calls"] for h in placed["subspace"][0]] == [2] * STEPS  # recomputed in backward
    assert_same_run(placed["subspace"], single["worker"]["subspace"])


def test_uneven_shards_are_exercised():
    """The worker's MLP has 91 rows (gate, up) and 91 columns (down): the last shards on 2 and 4 processes are
    shorter, and the down projection's column statistics span every shard."""
    from hf_recurrent.modeling_recurrent_depth import RecurrentDepthForCausalLM

    with torch.device("meta"):
        model = RecurrentDepthForCausalLM(worker.model_config())
    uneven = [name for name, p in model.named_parameters() if p.shape[0] % 2 and p.shape[0] % 4]
    assert any(name.endswith("gate_proj.weight") for name in uneven)


@pytest.mark.parametrize("stop_nproc,flags", [(4, ()), (2, ("--full_state", "--trainer_path"))],
                         ids=["sharded-checkpoint-from-4-to-2", "gathered-checkpoint-trainer-order"])
def test_resume_after_stop_reproduces_the_run(tmp_path, single, stop_nproc, flags):
    """Stopped after step 2 of 4 on `stop_nproc` processes and resumed on 2: a distributed checkpoint (each process
    its shards) on another process count, or one gathered on rank 0 (accelerate's FULL_STATE_DICT) in the Trainer's
    order. The first two steps' losses and the resumed run's losses and weights are the one process's, so on 4
    processes every update, the first with its fresh state included, equals the unsharded one."""
    mode = ("subspace",)
    losses, weights = single["trainer" if "--trainer_path" in flags else "worker"]["subspace"]
    stopped = run_worker(tmp_path / "stopped", stop_nproc, mode, "--stop_after", "2", *flags)["subspace"][0]
    assert [h["step"] for h in stopped] == [1, 2]
    torch.testing.assert_close(torch.tensor([h["loss"] for h in stopped]),
                               torch.tensor([h["loss"] for h in losses[:2]]), rtol=1e-5, atol=1e-6)
    assert os.listdir(tmp_path / "stopped" / "checkpoint")
    resumed = run_worker(tmp_path / "resumed", 2, mode, "--resume", str(tmp_path / "stopped" / "checkpoint"),
                         *flags)["subspace"]
    assert_same_run(resumed, (losses[2:], weights))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate runs FSDP2 on accelerators only")
def test_pretrain_under_accelerate_fsdp2_resumes_its_losses_and_saves_a_loadable_model(tiny_data_dir, tmp_path):
    """`accelerate launch --config_file accelerate_fsdp2_2x24gb.yaml` (on the GPUs there are, at most 2) with the
    default optimizer: a run stopped at a checkpoint and rerun to the end logs the uninterrupted run's losses, and
    its `final/` loads with `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    gpus = min(2, torch.cuda.device_count())

    def pretrain(out, max_steps):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   os.path.join(REPO, "trainer_ext", "configs", "accelerate_fsdp2_2x24gb.yaml"),
                   "--num_processes", str(gpus), os.path.join(REPO, "scripts", "run_pretrain.py"),
                   "--data_dir", tiny_data_dir, "--output_dir", str(out), "--max_steps", str(max_steps),
                   "--per_device_train_batch_size", "4", "--save_steps", "3", "--logging_steps", "1",
                   "--eval_strategy", "no", "--memory_plan", "none", "--lr_scheduler_type", "constant",
                   "--warmup_steps", "0", "--learning_rate", "3e-3", "--disable_tqdm", "true"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
                                env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        with open(out / "log_history.json") as f:
            return {e["step"]: e["loss"] for e in json.load(f) if "loss" in e and "step" in e}

    whole = pretrain(tmp_path / "whole", 6)
    pretrain(tmp_path / "stopped", 3)
    resumed = pretrain(tmp_path / "stopped", 6)  # a rerun resumes from checkpoint-3
    assert sorted(whole) == list(range(1, 7)) and whole[6] < whole[1]
    torch.testing.assert_close(torch.tensor([resumed[s] for s in (4, 5, 6)]),
                               torch.tensor([whole[s] for s in (4, 5, 6)]), rtol=0, atol=2e-3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "final", trust_remote_code=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    assert torch.isfinite(model(ids).logits).all()
