"""Errors that name the file and the fix (a data folder without its tokenizer, a run folder given as a model, a
truncated model.safetensors), progress that says what runs without flooding logs, and a resumed cycle's train_loss."""

import json
import logging
import os
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from hf_recurrent import RecurrentDepthForCausalLM, presets
from trainer_ext.cli import cache_teacher, evaluate_checkpoints as evaluate_script, run_pretrain
from trainer_ext.comparison.training import whole_run_train_loss
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.run.pretrain import parse_pretrain_args, parse_pretrain_job, pretrain
from trainer_ext.evaluation.generation import cache_mode_cost
from trainer_ext.evaluation.metrics import evaluate_model

QUICK = ["--max_steps", "2", "--save_steps", "2", "--eval_steps", "2", "--logging_steps", "1",
         "--max_eval_samples", "8", "--per_device_train_batch_size", "2"]


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir, tmp_path_factory):
    """A run_pretrain output folder as a finished run leaves it: checkpoint-N/ and final/, no config.json."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(presets.get("debug", vocab_size=len(tokenizer)))
    for name in ("checkpoint-2", "final"):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root)


@pytest.fixture
def truncated(run_dir, tmp_path):
    """A copy of the final checkpoint whose model.safetensors is cut in half (an interrupted download or copy)."""
    path = tmp_path / "truncated"
    shutil.copytree(os.path.join(run_dir, "final"), path)
    weights = path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    return str(path)


def _data_without_tokenizer(tiny_data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    for name in os.listdir(data):
        if name.startswith("tokenizer"):
            os.remove(data / name)
    return str(data)


# ----------------------------------------------------------------------------- errors naming the file and the fix


def test_data_dir_without_tokenizer_files_is_named_with_the_fix(tiny_data_dir, tmp_path):
    data = _data_without_tokenizer(tiny_data_dir, tmp_path)
    with pytest.raises(ValueError, match=r"--data_dir .*data has no tokenizer files.*save_pretrained") as err:
        run_pretrain.main(["--data_dir", data, "--output_dir", str(tmp_path / "out"), *QUICK])
    assert "sentencepiece" not in str(err.value)


def test_a_teacher_path_that_does_not_exist_is_named_as_such(tiny_data_dir, tmp_path):
    missing = str(tmp_path / "no-such-teacher")
    with pytest.raises(ValueError, match=rf"--teacher_model_name_or_path {missing}: no such directory; give a local "
                                         "checkpoint directory or a hub id"):
        cache_teacher.main(["--teacher_model_name_or_path", missing, "--data_dir", tiny_data_dir,
                            "--output_dir", str(tmp_path / "cache")])
    assert not (tmp_path / "cache").exists()


def test_teacher_given_as_a_run_folder_says_pass_its_final(tiny_data_dir, run_dir, tmp_path):
    final = os.path.join(run_dir, "final")
    with pytest.raises(ValueError, match=rf"--teacher_model_name_or_path {run_dir} .*pass {final}"):
        run_pretrain.main(["--data_dir", tiny_data_dir, "--teacher_model_name_or_path", run_dir,
                           "--output_dir", str(tmp_path / "out"), *QUICK])
    assert not os.path.exists(tmp_path / "out")  # refused before any work
    with pytest.raises(ValueError, match=rf"pass {final}"):
        cache_teacher.main(["--teacher_model_name_or_path", run_dir, "--data_dir", tiny_data_dir,
                            "--output_dir", str(tmp_path / "cache")])


def test_unfinished_run_folder_points_at_its_last_complete_checkpoint(tiny_data_dir, run_dir, tmp_path):
    unfinished = tmp_path / "unfinished"
    shutil.copytree(os.path.join(run_dir, "checkpoint-2"), unfinished / "checkpoint-2")
    (unfinished / "checkpoint-2" / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"pass {unfinished / 'checkpoint-2'}"):
        evaluate_script.main(["--checkpoints", str(unfinished), "--data_dir", tiny_data_dir,
                              "--output_dir", str(tmp_path / "eval")])


def test_truncated_weights_are_named_when_evaluating(tiny_data_dir, truncated, tmp_path):
    weights = os.path.join(truncated, "model.safetensors")
    with pytest.raises(ValueError, match=rf"{weights} is truncated or corrupt.*Download it again"):
        evaluate_script.main(["--checkpoints", truncated, "--data_dir", tiny_data_dir,
                              "--output_dir", str(tmp_path / "eval")])


@pytest.mark.parametrize("option", ["--model_name_or_path", "--teacher_model_name_or_path"])
def test_truncated_weights_are_named_when_training(tiny_data_dir, truncated, tmp_path, option):
    weights = os.path.join(truncated, "model.safetensors")
    with pytest.raises(ValueError, match=rf"{option} {truncated}: {weights} is truncated or corrupt"):
        run_pretrain.main(["--data_dir", tiny_data_dir, option, truncated, "--output_dir", str(tmp_path / "out"),
                           *QUICK])
    assert not os.path.exists(tmp_path / "out")


def test_truncated_teacher_weights_are_named_by_cache_teacher(tiny_data_dir, truncated, tmp_path):
    with pytest.raises(ValueError, match=r"model.safetensors is truncated or corrupt"):
        cache_teacher.main(["--teacher_model_name_or_path", truncated, "--data_dir", tiny_data_dir,
                            "--output_dir", str(tmp_path / "cache"), "--splits", "eval"])


# ----------------------------------------------------------------------------- progress


def test_evaluate_logs_the_speed_phase_and_where_results_went(tiny_data_dir, run_dir, tmp_path, caplog):
    out = tmp_path / "eval"
    with caplog.at_level(logging.INFO, logger="trainer_ext.evaluation"):
        evaluate_script.main(["--checkpoints", os.path.join(run_dir, "final"), "--data_dir", tiny_data_dir,
                              "--output_dir", str(out), "--depths", "1", "2", "--max_samples", "8",
                              "--new_tokens", "4", "--prompt_len", "8", "--speed_repeats", "1",
                              "--cache_cost_samples", "0", "--plots", "false"])
    messages = [record.getMessage() for record in caplog.records]
    for depth in (1, 2):
        assert any(f"generation speed at depth {depth}: 4 new tokens" in m for m in messages), messages
        assert any(f"generation speed at depth {depth} took" in m and "tokens/s" in m for m in messages), messages
    assert any(str(out / "results.json") in m and str(out / "results.md") in m for m in messages), messages


def test_our_progress_bars_stay_out_of_non_interactive_logs(tiny_data_dir, capsys):
    """Under pytest stderr is captured, as in a log file: no carriage-return bar lines may reach it."""
    dataset = torch.utils.data.Subset(ShardedTokenDataset(tiny_data_dir, "eval"), range(4))
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(presets.get("debug", vocab_size=384))
    capsys.readouterr()
    evaluate_model(model, dataset, num_steps=1, batch_size=2)
    cache_mode_cost(model, dataset, num_steps=1, max_samples=2, prefix_len=28)
    assert "\r" not in capsys.readouterr().err


def test_teacher_cache_logs_shards_instead_of_a_bar(tiny_data_dir, run_dir, tmp_path, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="trainer_ext.distill.caching"):
        cache_teacher.main(["--teacher_model_name_or_path", os.path.join(run_dir, "final"), "--data_dir",
                            tiny_data_dir, "--output_dir", str(tmp_path / "cache"), "--splits", "eval",
                            "--topk", "4", "--device", "cpu"])
    assert "Teacher top-k" not in capsys.readouterr().err
    assert any("Cached eval-00000.npy: shard 1/1" in r.getMessage() for r in caplog.records)


def test_trainer_bar_is_off_when_stderr_is_not_a_terminal_unless_asked_for(tmp_path):
    out = ["--output_dir", str(tmp_path / "out")]
    assert parse_pretrain_args(out)[2].disable_tqdm is True
    assert parse_pretrain_args(out + ["--disable_tqdm", "false"])[2].disable_tqdm is False
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "disable_tqdm": False}))
    assert parse_pretrain_args([str(config)])[2].disable_tqdm is False
    config.write_text(json.dumps({"output_dir": str(tmp_path / "out")}))
    assert parse_pretrain_args([str(config)])[2].disable_tqdm is True


# ----------------------------------------------------------------------------- a resumed cycle's train_loss


def test_train_loss_of_a_resumed_run_covers_every_step(tiny_data_dir, tmp_path):
    """A cycle killed after its checkpoint at step 2 and resumed to step 4: its train_loss is the mean over all
    four steps, not the Trainer's mean over the two after the resume."""
    out = str(tmp_path / "out")
    common = ["--data_dir", tiny_data_dir, "--output_dir", out, "--save_steps", "2", "--logging_steps", "1",
              "--eval_strategy", "no", "--per_device_train_batch_size", "2", "--max_eval_samples", "8"]
    pretrain(parse_pretrain_job(common + ["--max_steps", "2"]))
    metrics = pretrain(parse_pretrain_job(common + ["--max_steps", "4"]))  # resumes from checkpoint-2 by itself
    with open(os.path.join(out, "log_history.json"), encoding="utf-8") as f:
        log_history = json.load(f)
    losses = {entry["step"]: entry["loss"] for entry in log_history if "loss" in entry}
    assert sorted(losses) == [1, 2, 3, 4]
    # The Trainer's own figure covers the steps after the resume only (5.24), or divides them by all four (5.17).
    assert metrics["train_loss"] != pytest.approx(sum(losses.values()) / 4, rel=1e-4)
    whole = whole_run_train_loss(log_history, 2, metrics["train_loss"])
    assert whole == pytest.approx(sum(losses.values()) / 4, rel=1e-4)
    assert whole_run_train_loss(log_history, None, metrics["train_loss"]) == metrics["train_loss"]
