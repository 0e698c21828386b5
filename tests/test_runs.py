"""run_pretrain as a user runs it again and again: output directories (resume, refuse, start afresh), checkpoints
left half-written by a kill, and arguments checked before any work."""

import json
import logging
import os
import signal
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from trainer_ext.checkpoints import last_complete_checkpoint
from trainer_ext.training.arguments import RecurrentTrainingArguments
from trainer_ext.run.pretrain import parse_pretrain_args, parse_pretrain_job, pretrain
from trainer_ext.training.trainer import RecurrentTrainer


def run(data_dir, out, *extra):
    """A short debug-preset run: no evaluation during training, a checkpoint every 2 steps; a constant learning rate,
    so that a run continued to more steps follows the one trained to them at once."""
    return pretrain(parse_pretrain_job([
        "--data_dir", data_dir, "--output_dir", str(out), "--per_device_train_batch_size", "4",
        "--logging_steps", "1", "--eval_strategy", "no", "--save_steps", "2", "--max_eval_samples", "8",
        "--warmup_steps", "0", "--lr_scheduler_type", "constant", "--disable_tqdm", "true", "--use_cpu", "true",
        *extra]))


def logged_losses(out):
    with open(os.path.join(out, "log_history.json")) as f:
        return [entry["loss"] for entry in json.load(f) if "loss" in entry]


def listing(out):
    return sorted(os.listdir(out))


def final_weights(out):
    with open(os.path.join(out, "final", "model.safetensors"), "rb") as f:
        return f.read()


class SaveKilled(Exception):
    pass


# ----------------------------------------------------------------------------- output directories


def test_rerun_resumes_from_the_last_complete_checkpoint_and_says_which(tiny_data_dir, tmp_path, caplog):
    run(tiny_data_dir, tmp_path / "full", "--max_steps", "6")
    run(tiny_data_dir, tmp_path / "run", "--max_steps", "4")
    with caplog.at_level(logging.INFO, logger="trainer_ext.training.output_dir"):
        run(tiny_data_dir, tmp_path / "run", "--max_steps", "6")  # the same command, a larger budget
    assert f"Resuming from {tmp_path / 'run' / 'checkpoint-4'}" in caplog.text
    assert logged_losses(tmp_path / "run") == pytest.approx(logged_losses(tmp_path / "full"), rel=1e-6)
    assert listing(tmp_path / "run") == listing(tmp_path / "full")  # rotation kept the last two, no staging left


def test_finished_run_rerun_with_fewer_steps_is_refused_and_keeps_everything(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    run(tiny_data_dir, out, "--max_steps", "6")
    before, weights = listing(out), final_weights(out)
    with pytest.raises(ValueError, match=r"finished run at step 6.*--max_steps 4.*--overwrite_output_dir"):
        run(tiny_data_dir, out, "--max_steps", "4")
    assert listing(out) == before == ["checkpoint-4", "checkpoint-6", "final", "log_history.json",
                                      "stability_interventions.json"]
    assert final_weights(out) == weights


def test_non_empty_output_dir_without_a_checkpoint_is_refused_before_any_work(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"--output_dir .*run is not empty \(notes.txt\).*--overwrite_output_dir.*"
                                         r"another --output_dir"):
        run(tiny_data_dir, out, "--max_steps", "2")
    assert listing(out) == ["notes.txt"]


def test_overwrite_output_dir_starts_afresh(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    run(tiny_data_dir, out, "--max_steps", "6")
    run(tiny_data_dir, out, "--max_steps", "2", "--overwrite_output_dir", "true")
    # The old run's checkpoints are gone: a later automatic resume must not pick its step 6.
    assert listing(out) == ["checkpoint-2", "final", "log_history.json", "stability_interventions.json"]
    assert len(logged_losses(out)) == 2
    with pytest.raises(ValueError, match="pass one of them"):
        run(tiny_data_dir, out, "--max_steps", "4", "--overwrite_output_dir", "true",
            "--resume_from_checkpoint", str(out / "checkpoint-2"))


# ----------------------------------------------------------------------------- half-written checkpoints


def test_a_save_killed_midway_is_never_resumed_and_the_rerun_reproduces_the_losses(tiny_data_dir, tmp_path,
                                                                                     monkeypatch):
    run(tiny_data_dir, tmp_path / "full", "--max_steps", "6")
    out = tmp_path / "run"
    save_optimizer = RecurrentTrainer._save_optimizer_and_scheduler

    def killed_at_step_4(self, output_dir):
        if self.state.global_step == 4:  # weights are written by now, optimizer and trainer state are not
            raise SaveKilled
        save_optimizer(self, output_dir)

    with monkeypatch.context() as patch:
        patch.setattr(RecurrentTrainer, "_save_optimizer_and_scheduler", killed_at_step_4)
        with pytest.raises(SaveKilled):
            run(tiny_data_dir, out, "--max_steps", "6")
    # The half-written save stays under its staging name; only complete checkpoints carry the final name.
    assert listing(out) == ["checkpoint-2", "tmp-checkpoint-4"]
    assert os.path.isfile(out / "tmp-checkpoint-4" / "checkpoint-4" / "model.safetensors")
    assert last_complete_checkpoint(str(out)) == str(out / "checkpoint-2")

    run(tiny_data_dir, out, "--max_steps", "6")  # the same command again
    assert logged_losses(out) == pytest.approx(logged_losses(tmp_path / "full"), rel=1e-6)
    assert listing(out) == listing(tmp_path / "full")  # the leftover is cleared when step 4 is saved again


def _incomplete_checkpoint(path):
    """What a kill left before the atomic saves: weights and config, no trainer_state.json."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"")
    (path / "config.json").write_text("{}")


def test_resume_true_takes_the_last_complete_checkpoint_and_says_when_there_is_none(tiny_data_dir, tmp_path, caplog):
    out = tmp_path / "run"
    run(tiny_data_dir, out, "--max_steps", "2")
    _incomplete_checkpoint(out / "checkpoint-3")
    with caplog.at_level(logging.INFO, logger="trainer_ext.training.output_dir"):
        run(tiny_data_dir, out, "--max_steps", "4", "--resume_from_checkpoint", "true")
    assert f"Resuming from {out / 'checkpoint-2'}" in caplog.text
    assert len(logged_losses(out)) == 4

    empty = tmp_path / "empty"
    _incomplete_checkpoint(empty / "checkpoint-5")
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint true: .*empty holds no complete checkpoint.*"
                                         r"checkpoint-5 \(missing trainer_state.json\)"):
        run(tiny_data_dir, empty, "--max_steps", "2", "--resume_from_checkpoint", "true")
    # Found in --output_dir without the flag: refused as well, naming the incomplete folder.
    with pytest.raises(ValueError, match=r"no complete checkpoint.*checkpoint-5.*--overwrite_output_dir"):
        run(tiny_data_dir, empty, "--max_steps", "2")


def test_an_incomplete_checkpoint_given_explicitly_is_named(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    run(tiny_data_dir, out, "--max_steps", "2")
    _incomplete_checkpoint(out / "checkpoint-3")
    with pytest.raises(ValueError, match=r"checkpoint-3 is not a complete checkpoint \(missing trainer_state.json"
                                         r"[^)]*\).*the last complete checkpoint there is .*checkpoint-2"):
        run(tiny_data_dir, out, "--max_steps", "4", "--resume_from_checkpoint", str(out / "checkpoint-3"))
    with pytest.raises(ValueError, match=r"checkpoint-9 does not exist"):
        run(tiny_data_dir, out, "--max_steps", "4", "--resume_from_checkpoint", str(out / "checkpoint-9"))


# ----------------------------------------------------------------------------- arguments checked before any work


@pytest.mark.parametrize("flag, value, allowed", [
    ("eval_num_steps", 0, ">= 1"),
    ("backprop_depth", 0, ">= 1"),
    ("distill_alpha", 5.0, r"in \[0, 1\]"),
    ("distill_alpha", -0.1, r"in \[0, 1\]"),
    ("distill_temperature", 0.0, "> 0"),
    ("loss_chunk_size", 0, ">= 1"),
    ("profile_steps", -1, ">= 0"),
    ("optimizer_momentum", 1.0, r"in \[0, 1\)"),
    ("optimizer_clip_threshold", 0.0, "> 0"),
    ("peak_flops", -1.0, "> 0"),
])
def test_out_of_range_arguments_are_refused_naming_the_flag(tmp_path, flag, value, allowed):
    with pytest.raises(ValueError, match=rf"--{flag}={value!r} is not allowed; it must be [^;]*{allowed}"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{flag: value})


def test_bad_arguments_fail_before_anything_is_written(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="--distill_alpha"):
        run(tiny_data_dir, out, "--max_steps", "2", "--distill_alpha", "5")
    # The debug preset's mean_recurrence is known only from its config: still refused before training.
    with pytest.raises(ValueError, match=r"--backprop_depth=99 is larger than the model's mean_recurrence \(\d+\)"):
        run(tiny_data_dir, out, "--max_steps", "2", "--backprop_depth", "99")
    assert not out.exists()


def test_checks_needing_the_model_config_run_before_the_corpus_is_prepared(tmp_path, monkeypatch):
    """Without --data_dir the embedded corpus is prepared on first use: a depth beyond the preset's mean_recurrence,
    known from the preset and --config_overrides alone, is refused before that preparation writes anything."""
    from trainer_ext.run import job as job_module

    data, out = tmp_path / "data", tmp_path / "run"
    monkeypatch.setattr(job_module, "DEFAULT_DATA_DIR", str(data))
    args = ["--output_dir", str(out), "--max_steps", "2", "--use_cpu", "true"]
    with pytest.raises(ValueError, match=r"--backprop_depth=99 is larger than the model's mean_recurrence \(\d+\)"):
        pretrain(parse_pretrain_job([*args, "--backprop_depth", "99"]))
    with pytest.raises(ValueError, match=r"--backprop_depth=3 is larger than the model's mean_recurrence \(2\)"):
        pretrain(parse_pretrain_job([*args, "--backprop_depth", "3", "--config_overrides", "mean_recurrence=2"]))
    assert not data.exists() and not out.exists()


def test_a_finished_run_and_a_bad_teacher_are_refused_before_the_corpus_is_prepared(tiny_data_dir, tmp_path,
                                                                                   monkeypatch):
    from trainer_ext.run import job as job_module

    out = tmp_path / "run"
    run(tiny_data_dir, out, "--max_steps", "2")
    before = listing(out)
    teacher = tmp_path / "teacher"  # a model's weights and config, without its tokenizer files
    teacher.mkdir()
    for name in ("config.json", "model.safetensors"):
        (teacher / name).write_bytes((out / "checkpoint-2" / name).read_bytes())
    data = tmp_path / "data"
    monkeypatch.setattr(job_module, "DEFAULT_DATA_DIR", str(data))
    no_data = ["--use_cpu", "true", "--eval_strategy", "no"]
    with pytest.raises(ValueError, match=r"finished run at step 2.*--max_steps 2.*nothing left to train"):
        pretrain(parse_pretrain_job(["--output_dir", str(out), "--max_steps", "2", *no_data]))
    with pytest.raises(ValueError, match=rf"--teacher_model_name_or_path {teacher} has no tokenizer files"):
        pretrain(parse_pretrain_job(["--output_dir", str(tmp_path / "new"), "--max_steps", "2", *no_data,
                                       "--teacher_model_name_or_path", str(teacher)]))
    assert not data.exists() and not (tmp_path / "new").exists() and listing(out) == before


# ----------------------------------------------------------------------------- --config_overrides


def test_unknown_config_override_is_refused_with_the_close_match(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"'injecton' is not a field of RecurrentDepthConfig \(preset 'debug'\); "
                                         r"did you mean 'injection'\? Its fields: .*mean_recurrence"):
        run(tiny_data_dir, out, "--max_steps", "1", "--config_overrides", "injecton=add")
    with pytest.raises(ValueError, match=r"'num_layers' is not a field of LlamaConfig"):
        run(tiny_data_dir, out, "--max_steps", "1", "--preset", "transformer-debug",
            "--config_overrides", "num_layers=2")
    assert not out.exists()


def test_vocab_size_override_must_cover_the_tokenizer(tiny_data_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    with pytest.raises(ValueError, match=rf"vocab_size=100: the vocabulary comes from the data's tokenizer "
                                         rf"\({len(tokenizer)} tokens"):
        run(tiny_data_dir, tmp_path / "small", "--max_steps", "1", "--config_overrides", "vocab_size=100")
    out = tmp_path / "large"  # larger than the tokenizer (a teacher's padded vocabulary): taken, padded to 64
    run(tiny_data_dir, out, "--max_steps", "1", "--config_overrides", "vocab_size=1000,mean_recurrence=2")
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["vocab_size"] == 1024 and config["mean_recurrence"] == 2


# ----------------------------------------------------------------------------- remote code only with consent


def test_remote_code_is_off_by_default_and_our_checkpoints_load_without_it(tiny_data_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from trainer_ext.distill.caching import CacheTeacherArguments

    model_args = parse_pretrain_args(["--use_cpu", "true"])[0]
    assert model_args.trust_remote_code is False
    assert CacheTeacherArguments("teacher", "data", "out").trust_remote_code is False
    run(tiny_data_dir, tmp_path / "first", "--max_steps", "1")
    final = str(tmp_path / "first" / "final")

    calls = []
    original = AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        calls.append((args[0], kwargs.get("trust_remote_code")))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    # Continued training from, and distillation by, a recurrent-depth checkpoint: no remote code is needed.
    run(tiny_data_dir, tmp_path / "second", "--max_steps", "1", "--model_name_or_path", final,
        "--teacher_model_name_or_path", final)
    assert calls == [(final, False), (final, False)]
    calls.clear()
    run(tiny_data_dir, tmp_path / "third", "--max_steps", "1", "--model_name_or_path", final, "--trust_remote_code",
        "true")
    assert calls == [(final, True)]


def test_console_entry_points_exit_zero_after_a_successful_run(tiny_data_dir, tmp_path):
    from importlib.metadata import entry_points

    scripts = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name.startswith("hf-recurrent-")}
    assert {"hf-recurrent-pretrain", "hf-recurrent-evaluate", "hf-recurrent-compare",
            "hf-recurrent-cache-teacher", "hf-recurrent-find-lr", "hf-recurrent-prepare-data"} <= set(scripts)
    pretrain = scripts["hf-recurrent-pretrain"].load()  # what the installed command calls, as sys.exit(pretrain())
    code = pretrain(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "run"), "--max_steps", "2",
                     "--per_device_train_batch_size", "4", "--eval_strategy", "no", "--save_strategy", "no",
                     "--max_eval_samples", "8", "--disable_tqdm", "true", "--use_cpu", "true"])
    assert code == 0 and os.path.isfile(tmp_path / "run" / "final" / "model.safetensors")
    evaluate = scripts["hf-recurrent-evaluate"].load()
    assert evaluate(["--checkpoints", str(tmp_path / "run" / "final"), "--data_dir", tiny_data_dir, "--depths", "1",
                     "--max_samples", "4", "--new_tokens", "2", "--prompt_len", "4", "--cache_cost_samples", "0",
                     "--no_plots", "--output_dir", str(tmp_path / "eval")]) == 0


def test_two_processes_on_a_fresh_folder_prepare_the_embedded_corpus_once(tmp_path):
    """`torchrun --nproc_per_node 2 scripts/run_pretrain.py` before the embedded corpus exists: the main process
    prepares it while the other waits (both writing the same shard files broke the second one), then both train."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(repo, "scripts", "run_pretrain.py"), "--use_cpu", "true", "--max_steps", "2",
               "--per_device_train_batch_size", "4", "--eval_strategy", "no", "--save_strategy", "no",
               "--save_final", "false", "--max_eval_samples", "8", "--logging_steps", "1", "--disable_tqdm", "true"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # own group: a hung collective is ended whole
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    assert output.count("Preparing the embedded corpus") == 1
    data = tmp_path / "outputs" / "data" / "kjv"
    assert (data / "manifest.json").is_file() and not list(data.glob(".*.tmp"))
    assert len([e for e in json.loads((tmp_path / "outputs" / "run_pretrain" / "log_history.json").read_text())
                if "loss" in e]) == 2
