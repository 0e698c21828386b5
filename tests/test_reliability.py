"""Nothing lost, nothing silent: a full disk (data preparation, checkpoints), progress that suits a log file, and
SIGINT / SIGTERM during training (a checkpoint of the step under way, then an exit that says so)."""

import contextlib
import errno
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from transformers import TrainerCallback

from trainer_ext.data.prepare import PrepareDataArguments, prepare
from trainer_ext.run.pretrain import parse_pretrain_job, pretrain
from trainer_ext.training.trainer import RecurrentTrainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_ARGS = ["--per_device_train_batch_size", "4", "--logging_steps", "1", "--eval_strategy", "no",
            "--max_eval_samples", "8", "--warmup_steps", "0", "--lr_scheduler_type", "constant", "--disable_tqdm",
            "true", "--use_cpu", "true"]


def run(data_dir, out, *extra, callbacks=None):
    """A short debug-preset run without evaluation during training (as tests/test_runs.py's)."""
    return pretrain(parse_pretrain_job(["--data_dir", data_dir, "--output_dir", str(out), *RUN_ARGS, *extra]),
                    callbacks=callbacks)


def logged_losses(out):
    with open(os.path.join(out, "log_history.json")) as f:
        return [entry["loss"] for entry in json.load(f) if "loss" in entry]


MAX_STEPS = "6"


@pytest.fixture(scope="module")
def uninterrupted(tiny_data_dir, tmp_path_factory):
    """A run of MAX_STEPS steps that nothing stops: its losses, and its log lines as the Trainer printed them."""
    out = tmp_path_factory.mktemp("uninterrupted")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run(tiny_data_dir, out, "--max_steps", MAX_STEPS, "--save_steps", "2")
    return SimpleNamespace(losses=logged_losses(out), printed=printed.getvalue())


def fake_free_space(monkeypatch, free: dict):
    """shutil.disk_usage answering `free["bytes"]` free bytes for every folder (changed by the test as it goes)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=0, free=free["bytes"]))


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def data_args(out, tokenizer_dir, **extra):
    """A small preparation with the tokenizer of tiny_data_dir (no BPE training)."""
    return PrepareDataArguments(**{"output_dir": str(out), "tokenizer": tokenizer_dir, "max_documents": 60,
                                   "seq_len": 32, "eval_samples": 8, "shard_size": 100, **extra})


# ----------------------------------------------------------------------------- a full disk: data preparation


def test_prepare_refuses_a_disk_too_small_before_writing(tiny_data_dir, tmp_path, monkeypatch):
    fake_free_space(monkeypatch, {"bytes": 50_000})
    out = tmp_path / "data"
    # 40,000 uint16 tokens in the stream, as much again in the shards: 160,000 bytes.
    with pytest.raises(OSError, match=rf"Not enough free space in {re.escape(str(out))} for the token stream and "
                                      r"shards of about 40,000 tokens \(uint16\): it needs about 156.2 KiB, the disk "
                                      r"has 48.8 KiB free. Free at least 107.4 KiB there, lower --max_tokens"):
        prepare(data_args(out, tiny_data_dir, max_tokens=40_000))
    assert not [name for name in os.listdir(out) if name.endswith((".npy", ".tmp", ".bin"))]


def test_prepare_on_a_full_disk_removes_its_stream_and_a_rerun_works(tiny_data_dir, tmp_path, monkeypatch):
    import trainer_ext.data.prepare as prepare_module

    free = {"bytes": 10**12}
    fake_free_space(monkeypatch, free)
    out = tmp_path / "data"

    def fills_the_disk(documents, tokenizer, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\0" * 3000)
        free["bytes"] = 1000
        raise disk_full()

    with monkeypatch.context() as patch:
        patch.setattr(prepare_module, "pack_token_stream", fills_the_disk)
        with pytest.raises(OSError, match=rf"The disk is full: writing the prepared data to {re.escape(str(out))} "
                                          r"failed \(OSError: .*No space left on device\)\. Removed the partial files "
                                          r"\(.tokens.bin.tmp\)\. It needs about 5.9 KiB and 1000 B are free now: free "
                                          r"at least 4.9 KiB more there"):
            prepare(data_args(out, tiny_data_dir))
    assert not os.path.exists(out / ".tokens.bin.tmp")
    free["bytes"] = 10**12  # space freed: the same command works
    manifest = prepare(data_args(out, tiny_data_dir))
    assert manifest["splits"]["train"]["num_samples"] > 0


def test_prepare_on_a_disk_full_while_writing_shards_removes_stream_and_shards(tiny_data_dir, tmp_path,
                                                                               monkeypatch):
    import trainer_ext.data.shards as shards

    free = {"bytes": 10**12}
    fake_free_space(monkeypatch, free)
    out = tmp_path / "data"
    write_shard = shards.write_shard

    def second_shard_fills_the_disk(path, samples):
        if os.path.basename(path) != "train-00001.npy":
            return write_shard(path, samples)
        with open(os.path.join(os.path.dirname(path), ".train-00001.npy.tmp"), "wb") as f:
            f.write(b"\0" * 100)  # what a write cut short leaves
        free["bytes"] = 0
        raise disk_full()

    with monkeypatch.context() as patch:
        patch.setattr(shards, "write_shard", second_shard_fills_the_disk)
        with pytest.raises(OSError, match=r"The disk is full: .*Removed the partial files \(.tokens.bin.tmp, "
                                          r".train-00001.npy.tmp, train-00000.npy\)\. It needs about .* and 0 B are "
                                          r"free now: free at least .* more there"):
            prepare(data_args(out, tiny_data_dir, shard_size=20))
    assert not [name for name in os.listdir(out) if name.endswith((".npy", ".tmp"))]
    free["bytes"] = 10**12
    assert prepare(data_args(out, tiny_data_dir, shard_size=20))["splits"]["train"]["num_samples"] > 20


def test_the_long_write_helper_refuses_a_shortfall_and_cleans_up_after_a_full_disk(tmp_path, monkeypatch):
    """`files.disk_space_for`, for writers such as the teacher cache: both numbers and the folder before writing,
    its temporary files removed and the space still needed after a write that filled the disk."""
    from trainer_ext.files import disk_space_for

    free = {"bytes": 2000}
    fake_free_space(monkeypatch, free)
    with pytest.raises(OSError, match=rf"Not enough free space in {re.escape(str(tmp_path))} for shard 3: it needs "
                                      r"about 4.9 KiB, the disk has 2.0 KiB free\. Free at least 2.9 KiB there, "
                                      r"rebuild fewer shards, or write to another folder"):
        with disk_space_for(str(tmp_path), 5000, "shard 3", fix="rebuild fewer shards"):
            raise AssertionError("the write must not start")
    free["bytes"] = 10_000
    tmp_file = tmp_path / ".shard-3.tmp"
    with pytest.raises(OSError, match=r"The disk is full: writing shard 3 to .* Removed the partial files "
                                      r"\(.shard-3.tmp\)\. It needs about 4.9 KiB and 1000 B are free now: free at "
                                      r"least 3.9 KiB more there"):
        with disk_space_for(str(tmp_path), 5000, "shard 3", remove=[str(tmp_file)]):
            tmp_file.write_bytes(b"\0" * 100)
            free["bytes"] = 1000
            raise disk_full()
    assert not tmp_file.exists()
    free["bytes"] = 10_000
    with pytest.raises(ValueError, match="not a disk problem"):  # other failures pass through unchanged
        with disk_space_for(str(tmp_path), 5000, "shard 3", remove=[str(tmp_file)]):
            raise ValueError("not a disk problem")


# ----------------------------------------------------------------------------- a full disk: checkpoints


def test_checkpoint_save_refuses_a_disk_too_small_naming_both_sizes(tiny_data_dir, tmp_path, monkeypatch):
    fake_free_space(monkeypatch, {"bytes": 1000})
    out = tmp_path / "run"
    with pytest.raises(OSError, match=rf"Not enough free space in {re.escape(str(out))} for checkpoint-2: it needs "
                                      r"about [\d.]+ [KMG]iB, the disk has 1000 B free\. Free at least .* there, "
                                      r"delete checkpoints no longer needed or lower --save_total_limit"):
        run(tiny_data_dir, out, "--max_steps", "2", "--save_steps", "2")
    assert not [name for name in os.listdir(out) if "checkpoint" in name]


def test_checkpoint_save_on_a_full_disk_removes_the_staging_folder_and_the_rerun_resumes(tiny_data_dir, tmp_path,
                                                                                        monkeypatch, uninterrupted):
    from trainer_ext.files import is_disk_full

    # What torch.save raises when the disk fills under it: named a full disk too.
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1918144 vs 1918032"))
    free = {"bytes": 10**12}
    fake_free_space(monkeypatch, free)
    out = tmp_path / "run"
    save_optimizer = RecurrentTrainer._save_optimizer_and_scheduler

    def fills_the_disk_at_step_4(self, output_dir):
        if self.state.global_step != 4:
            return save_optimizer(self, output_dir)
        with open(os.path.join(output_dir, "optimizer.pt"), "wb") as f:
            f.write(b"\0" * 1000)
        free["bytes"] = 1000
        raise disk_full()

    with monkeypatch.context() as patch:
        patch.setattr(RecurrentTrainer, "_save_optimizer_and_scheduler", fills_the_disk_at_step_4)
        with pytest.raises(OSError, match=rf"The disk is full: writing checkpoint-4 to {re.escape(str(out))} failed "
                                          r".*Removed the partial files \(tmp-checkpoint-4\)\. It needs about .* and "
                                          r"1000 B are free now: free at least .* more there"):
            run(tiny_data_dir, out, "--max_steps", MAX_STEPS, "--save_steps", "2")
    assert sorted(os.listdir(out)) == ["checkpoint-2"]
    free["bytes"] = 10**12
    run(tiny_data_dir, out, "--max_steps", MAX_STEPS, "--save_steps", "2")  # the same command, space freed
    assert logged_losses(out) == pytest.approx(uninterrupted.losses, rel=1e-6)


# ----------------------------------------------------------------------------- progress in a log file


@pytest.fixture
def progress_lines(monkeypatch, caplog):
    """Progress lines every 10 ms (the default is 30 s), as logged; stdout and stderr are not terminals here."""
    monkeypatch.setenv("HF_RECURRENT_PROGRESS_INTERVAL", "0.01")
    caplog.set_level(logging.INFO, logger="trainer_ext.progress")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "trainer_ext.progress"]


def test_progress_logs_done_total_rate_and_time_left_instead_of_a_bar(progress_lines, capsys):
    from trainer_ext.progress import Progress

    with Progress(total=20, desc="work", unit="item") as progress:
        for _ in range(10):
            time.sleep(0.01)
            progress.update(1)
        progress.set_postfix(shard="3/7")
        time.sleep(0.05)
    lines = progress_lines()
    assert any(re.fullmatch(r"work: 10/20 item \(50%\), [\d.,]+ item/s, \d+s left, elapsed \d+s, shard=3/7", line)
               for line in lines), lines
    assert re.fullmatch(r"work: 10/20 item \(50%\), [\d.,]+ item/s, done in \d+s, shard=3/7", lines[-1]), lines
    assert "\r" not in capsys.readouterr().err


def test_progress_draws_a_bar_on_a_terminal_and_logs_nothing(progress_lines, monkeypatch, capsys):
    import trainer_ext.progress as progress_module

    monkeypatch.setattr(progress_module, "on_terminal", lambda: True)
    with progress_module.Progress(total=3, desc="work", unit="item") as progress:
        for _ in range(3):
            time.sleep(0.02)
            progress.update(1)
    assert "work: 100%" in capsys.readouterr().err and progress_lines() == []


def test_tokenization_bpe_training_and_evaluation_log_progress(progress_lines, tiny_data_dir, tmp_path, capsys):
    import torch

    from hf_recurrent import RecurrentDepthForCausalLM, presets
    from trainer_ext.data.shards import ShardedTokenDataset
    from trainer_ext.evaluation.metrics import evaluate_model

    prepare(PrepareDataArguments(output_dir=str(tmp_path / "data"), max_documents=60, vocab_size=384, seq_len=32,
                                 eval_samples=8))
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(presets.get("debug", vocab_size=384))
    decoder = model.base_model  # what evaluate_model runs (the LM head is applied in chunks after it)
    forward = decoder.forward

    calls = []

    def slow_forward(*args, **kwargs):  # a phase shorter than the interval logs nothing: make each batch last
        calls.append(1)
        time.sleep(0.02)
        return forward(*args, **kwargs)

    decoder.forward = slow_forward
    eval_set = torch.utils.data.Subset(ShardedTokenDataset(tiny_data_dir, "eval"), range(6))
    evaluate_model(model, eval_set, num_steps=2, batch_size=2)
    assert len(calls) == 3  # each of the 3 batches took at least 20 ms
    lines = progress_lines()
    for phase in (r"BPE training: [\d,]+/60 doc", r"Packing: \S+ tok", r"eval n=2: \d/3 batch \(\d+%\)"):
        assert any(re.match(phase, line) for line in lines), (phase, lines)
    assert "\r" not in capsys.readouterr().err


def test_comparison_stages_log_progress_lines(progress_lines):
    from trainer_ext.comparison.progress import RunProgress

    progress = RunProgress(total=5, done=1)
    progress.begin(1, "recurrent", "train")
    progress.training_step(1, "recurrent", 5, 10, 20_000)
    time.sleep(0.05)
    progress.close()
    line = (r"compare: 1.5/5 stage \(30%\), [\d.,]+ (stage/s|s/stage), \S+ left, elapsed \d+s, "
            r"cycle=1, model=recurrent, step=5/10, tokens=20\S*")
    assert any(re.fullmatch(line, logged) for logged in progress_lines()), progress_lines()


def test_training_log_lines_carry_the_step(uninterrupted):
    printed = [line for line in uninterrupted.printed.splitlines() if "'loss'" in line]
    assert len(printed) == int(MAX_STEPS), uninterrupted.printed
    for step, line in enumerate(printed, start=1):
        assert f"'step': {step}" in line, line


# ----------------------------------------------------------------------------- SIGINT and SIGTERM during training


class SignalAtStep(TrainerCallback):
    """Sends `signum` to this process while the step `step` runs (before its end)."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def test_sigint_saves_the_step_under_way_exits_130_and_the_rerun_reproduces_the_losses(tiny_data_dir, tmp_path,
                                                                                      caplog, uninterrupted):
    out = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        try:
            run(tiny_data_dir, out, "--max_steps", MAX_STEPS, "--save_steps", "2",
                callbacks=[SignalAtStep(signal.SIGINT, 3)])
        except KeyboardInterrupt as err:  # Python's own handling of SIGINT: the steps since the last save are lost
            raise AssertionError("SIGINT ended training with KeyboardInterrupt, saving nothing") from err
    assert stopped.value.code == 130
    assert f"Training stopped by SIGINT at step 3, saved as {out / 'checkpoint-3'}" in caplog.text
    listing = os.listdir(out)
    assert "checkpoint-3" in listing and "final" not in listing  # the run did not finish
    assert signal.getsignal(signal.SIGINT) is handler  # restored after train()
    run(tiny_data_dir, out, "--max_steps", MAX_STEPS, "--save_steps", "2")  # the same command resumes
    assert logged_losses(out) == pytest.approx(uninterrupted.losses, rel=1e-6)


def test_sigterm_to_a_training_process_saves_exits_143_and_the_rerun_reproduces_the_losses(tiny_data_dir, tmp_path,
                                                                                           uninterrupted):
    out = tmp_path / "run"
    # No regular save: the only checkpoint is the one the signal asks for.
    args = ["--data_dir", tiny_data_dir, "--output_dir", str(out), *RUN_ARGS, "--max_steps", MAX_STEPS,
            "--save_steps", "100"]
    process = subprocess.Popen([sys.executable, "-u", os.path.join(REPO, "scripts", "run_pretrain.py"), *args],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": REPO})
    try:
        for line in process.stdout:  # the first logged step
            if "'loss'" in line:
                process.send_signal(signal.SIGTERM)
                break
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143, stderr[-3000:]
    step = int(re.search(r"Training stopped by SIGTERM at step (\d+), saved as ", stderr).group(1))
    assert 1 <= step < int(MAX_STEPS), step
    assert [name for name in os.listdir(out) if name != "stability_interventions.json"] == [f"checkpoint-{step}"]
    run(tiny_data_dir, out, "--max_steps", MAX_STEPS, "--save_steps", "100")  # the same command resumes from it
    assert logged_losses(out) == pytest.approx(uninterrupted.losses, rel=1e-6)


def test_a_second_signal_exits_at_once(tmp_path):
    script = ("import os, signal, time\n"
              "from trainer_ext.training.callbacks import StopOnSignalCallback\n"
              "stop = StopOnSignalCallback()\n"
              "with stop.handling():\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    assert stop.received == signal.SIGTERM\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(60)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 143 and time.monotonic() - start < 30, done.stderr
    assert "SIGTERM again: exiting at once, without saving" in done.stderr
