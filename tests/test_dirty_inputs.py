"""Dirty inputs and flags that used to crash late or pass silently: JSONL with bytes that are not UTF-8, cut-off lines
and empty files; step counts and rates out of range; and the smaller cases (a checkpoint's tokenizer asking to run
code, gradient accumulation refused without naming the flag, the final evaluation run twice, planned tokens/s
without the device they are for). CPU, seconds each."""

import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer, TrainerCallback

from trainer_ext.cli import run_pretrain
from trainer_ext.comparison.arguments import CompareDataArguments
from trainer_ext.data import prepare as prepare_module
from trainer_ext.data.prepare import PrepareDataArguments, prepare
from trainer_ext.optim.in_backward import check_gradient_accumulation
from trainer_ext.run.pretrain import parse_pretrain_args, parse_pretrain_job, pretrain

SEQ_LEN = 16


def _lines(count: int, start: int = 0) -> list[bytes]:
    """`count` JSON Lines of Japanese text (3 bytes per character in UTF-8), as bytes without newlines."""
    text = "日本語のテキストです。" * 4
    return [json.dumps({"text": f"文書 {i}: {text}", "id": i}, ensure_ascii=False).encode()
            for i in range(start, start + count)]


def _write(path, lines: list[bytes]) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _prepare(tmp_path, files, **kwargs) -> dict:
    return prepare(PrepareDataArguments(files=[str(f) for f in files], output_dir=str(tmp_path / "data"),
                                        vocab_size=300, seq_len=SEQ_LEN, eval_samples=1, **kwargs))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- dirty JSONL


def test_jsonl_bytes_that_are_not_utf8_become_replacements_and_the_file_is_named(tmp_path, caplog):
    # A stray Shift_JIS byte inside a string: pyarrow raised a UnicodeDecodeError naming no file, mid-way.
    lines = _lines(40)
    lines[4] = lines[4].replace("テキスト".encode(), b"\x83\x65\xff", 1)
    path = _write(tmp_path / "web.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        manifest = _prepare(tmp_path, [path])
    assert manifest["total_tokens"] > 0 and "skipped_records" not in manifest
    replaced = [m for m in _warnings(caplog) if "U+FFFD" in m]
    assert len(replaced) == 1 and f"{path}: 2" in replaced[0] and "iconv" in replaced[0]


def test_bad_jsonl_lines_are_left_out_counted_and_the_first_is_named(tmp_path, caplog):
    # A cut-off line (ends inside a multi-byte character) and a byte outside any string: pyarrow raised
    # `ArrowInvalid: JSON parse error ... in row 99`, naming neither the file nor the line.
    lines = _lines(120)
    lines[9] = lines[9][:25]
    lines[99] = lines[99][:40]
    lines[110] = b'{"text": "x"}\x81'
    lines[115] = b'["an array, not an object"]'
    path = _write(tmp_path / "cut.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        manifest = _prepare(tmp_path, [path])
    assert manifest["skipped_records"][path]["count"] == 4
    assert manifest["skipped_records"][path]["first"] == "line 10"
    assert manifest["num_documents"] == 116
    first = [m for m in _warnings(caplog) if m.startswith(f"{path}:10: not valid JSON")]
    assert len(first) == 1 and "--on_bad_lines skip" in first[0]  # logged once, though BPE and packing both read it
    summary = [m for m in _warnings(caplog) if m.startswith("Left out 4 JSON records")]
    assert len(summary) == 1 and "--on_bad_lines error" in summary[0] and "first: line 10" in summary[0]


def test_on_bad_lines_error_refuses_the_file_and_line_before_any_work(tmp_path, monkeypatch):
    good = _write(tmp_path / "a.jsonl", _lines(30))
    lines = _lines(50, start=30)
    lines[44] = lines[44][:-3]
    bad = _write(tmp_path / "b.jsonl", lines)
    _prepare(tmp_path, [good])  # data from an earlier run, which the refused one must leave alone
    before = sorted(os.listdir(tmp_path / "data"))

    def no_work(*args, **kwargs):
        raise AssertionError("the refusal must come before the tokenizer is trained")

    monkeypatch.setattr(prepare_module, "train_bpe_tokenizer", no_work)
    with pytest.raises(ValueError, match=rf"{bad}:45: not valid JSON .*--on_bad_lines skip"):
        _prepare(tmp_path, [good, bad], on_bad_lines="error", overwrite=True)
    assert sorted(os.listdir(tmp_path / "data")) == before
    with pytest.raises(ValueError, match="--on_bad_lines must be one of"):
        PrepareDataArguments(files=[good], output_dir=str(tmp_path / "x"), on_bad_lines="ignore")


def test_the_comparison_passes_on_bad_lines_to_its_data_preparation(tmp_path):
    lines = _lines(50)
    lines[44] = lines[44][:-3]
    bad = _write(tmp_path / "b.jsonl", lines)
    data = CompareDataArguments(files=[bad], on_bad_lines="error", eval_tokens=2000, seq_len=64)
    with pytest.raises(ValueError, match=rf"{bad}:45: not valid JSON .*--on_bad_lines skip"):
        prepare(data.prepare_args(str(tmp_path / "data")))
    assert CompareDataArguments(files=[bad]).prepare_args(str(tmp_path / "d")).on_bad_lines == "skip"
    with pytest.raises(ValueError, match="--on_bad_lines must be one of"):
        CompareDataArguments(files=[bad], on_bad_lines="ignore")


def test_empty_files_are_named_and_skipped_and_only_empty_files_are_refused(tmp_path, caplog):
    # An empty .jsonl ended in a bare StopIteration, an empty .parquet in `Parquet file size is 0 bytes`.
    empty_jsonl, empty_parquet = tmp_path / "empty.jsonl", tmp_path / "empty.parquet"
    empty_jsonl.touch()
    empty_parquet.touch()
    good = _write(tmp_path / "good.jsonl", _lines(30))
    with caplog.at_level(logging.WARNING):
        manifest = _prepare(tmp_path, [empty_jsonl, good, empty_parquet])
    assert manifest["num_documents"] == 30
    for path in (empty_jsonl, empty_parquet):
        assert any(m.startswith(f"{path} is empty") and "skipped" in m for m in _warnings(caplog))
    with pytest.raises(ValueError, match="--files: no file holds any text"):
        _prepare(tmp_path, [empty_jsonl, empty_parquet], overwrite=True)


def test_a_text_column_no_object_has_is_refused_before_any_work(tmp_path, monkeypatch):
    path = _write(tmp_path / "content.jsonl", [json.dumps({"content": "abc", "id": i}).encode() for i in range(5)])
    monkeypatch.setattr(prepare_module, "train_bpe_tokenizer", None)  # never reached
    with pytest.raises(ValueError, match=r"none of its first 5 JSON objects has a 'text' string .*'content'.*"
                                         r"--text_column"):
        _prepare(tmp_path, [path])


def test_json_array_files_still_read_and_gzip_files_too(tmp_path):
    import gzip

    docs = [json.loads(line)["text"] for line in _lines(20)]
    (tmp_path / "array.json").write_text(json.dumps([{"text": d} for d in docs[:10]] + docs[10:] + [3]))
    with gzip.open(tmp_path / "lines.jsonl.gz", "wb") as f:
        f.write(b"\n".join(_lines(20)) + b"\n")
    manifest = _prepare(tmp_path, [tmp_path / "array.json", tmp_path / "lines.jsonl.gz"])
    assert manifest["num_documents"] == 40
    assert manifest["skipped_records"] == {str(tmp_path / "array.json"): {
        "count": 1, "first": "item 21", "reason": "a JSON number where an object with a 'text' field was expected"}}
    (tmp_path / "broken.json").write_text('[{"text": "a"},\n {"text": "b"\n')
    with pytest.raises(ValueError, match=r"broken.json:3: not valid JSON .*convert it to JSON Lines"):
        _prepare(tmp_path, [tmp_path / "broken.json"], overwrite=True)


def test_jsonl_reads_as_before_next_to_text_and_parquet(tmp_path):
    """The same documents, in the same order, as datasets' JSON builder gave: extra fields are dropped."""
    lines = _lines(12)
    path = _write(tmp_path / "a.jsonl", lines)
    (tmp_path / "b.txt").write_text("plain text " * 30, encoding="utf-8")
    pq.write_table(pa.table({"text": ["parquet text " * 20]}), tmp_path / "c.parquet")
    from trainer_ext.data.corpus import load_local_files

    texts = [row["text"] for row in load_local_files([path, str(tmp_path / "b.txt"), str(tmp_path / "c.parquet")])]
    assert texts == [json.loads(line)["text"] for line in lines] + ["plain text " * 30, "parquet text " * 20]


# ----------------------------------------------------------------------------- ranges of step counts and rates


@pytest.mark.parametrize("flag, value", [
    ("max_steps", "0"), ("max_steps", "-5"), ("learning_rate", "-1e-3"), ("learning_rate", "0"),
    ("warmup_steps", "-1"), ("num_train_epochs", "0"), ("save_steps", "0"), ("save_steps", "-3"),
    ("logging_steps", "-2"), ("eval_steps", "-2"), ("eval_steps", "2.5"), ("per_device_train_batch_size", "0"),
    ("per_device_eval_batch_size", "0"), ("weight_decay", "-0.1"), ("adam_beta2", "1.0"), ("adam_epsilon", "0"),
    ("max_eval_samples", "0"),
])
def test_step_counts_and_rates_out_of_range_are_refused_naming_the_flag(flag, value, tmp_path):
    argv = ["--output_dir", str(tmp_path / "out"), f"--{flag}={value}", "--eval_strategy", "steps"]
    with pytest.raises(ValueError, match=rf"^--{flag}=\S+ is not allowed; it must be"):
        parse_pretrain_args(argv)


def test_in_range_values_and_transformers_conventions_still_parse(tmp_path):
    args = parse_pretrain_args(["--output_dir", str(tmp_path / "out"), "--max_steps", "-1", "--num_train_epochs",
                                "0.5", "--warmup_steps", "0.1", "--save_steps", "0.25", "--eval_strategy", "steps",
                                "--learning_rate", "1e-4", "--save_strategy", "no", "--eval_steps", "0.25"])[2]
    assert args.max_steps == -1 and args.warmup_steps == 0.1 and args.eval_steps == 0.25
    assert parse_pretrain_args(["--output_dir", str(tmp_path / "o"), "--save_steps=-1", "--save_strategy", "no"])


def test_a_negative_learning_rate_is_refused_before_anything_is_written(tiny_data_dir, tmp_path, monkeypatch):
    # It used to fail in the optimizer ("lr must be >= 0"), after the data and the model were built, leaving an
    # empty output folder.
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--learning_rate=-0.001 is not allowed"):
        run_pretrain.main(["--data_dir", tiny_data_dir, "--output_dir", str(out), "--learning_rate=-1e-3",
                           "--max_steps", "2", "--per_device_train_batch_size", "2"])
    assert os.listdir(tmp_path) == []


def test_gradient_accumulation_in_backward_names_the_flag_to_turn_off(tmp_path):
    with pytest.raises(ValueError, match="--gradient_accumulation_steps=4 .*--optimizer_in_backward false"):
        parse_pretrain_args(["--output_dir", str(tmp_path / "out"), "--gradient_accumulation_steps", "4"])
    args = parse_pretrain_args(["--output_dir", str(tmp_path / "out"), "--gradient_accumulation_steps", "4",
                                "--optimizer_in_backward", "false"])[2]
    assert args.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match=r"in_backward=False") as raised:  # the library keeps its own names
        check_gradient_accumulation(4)
    assert "--" not in str(raised.value)


# ----------------------------------------------------------------------------- smaller items


def test_the_final_evaluation_runs_once(tiny_data_dir, tmp_path):
    class CountEvaluations(TrainerCallback):
        steps = []

        def on_evaluate(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    counter = CountEvaluations()
    job = parse_pretrain_job(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "out"), "--max_steps",
                              "2", "--eval_steps", "2", "--save_strategy", "no", "--logging_steps", "1",
                              "--max_eval_samples", "4", "--per_device_train_batch_size", "2", "--save_final",
                              "false"])
    metrics = pretrain(job, callbacks=[counter])
    assert counter.steps == [2]  # the Trainer's evaluation at the last step serves as the final one
    with open(tmp_path / "out" / "log_history.json") as f:
        logged = [entry for entry in json.load(f) if "eval_loss" in entry]
    assert len(logged) == 1 and metrics["eval_loss"] == logged[0]["eval_loss"]


def test_a_checkpoint_tokenizer_loads_for_new_data_without_the_remote_code_prompt(tiny_data_dir, tmp_path,
                                                                                  monkeypatch):
    """transformers 5's AutoTokenizer reads config.json through AutoConfig, which asks on the terminal whether to run
    the code auto_map names for a model type it does not know. prepare-data --tokenizer CHECKPOINT must not ask."""
    import builtins

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_recurrent import presets
    from trainer_ext.data.tokenizer import load_tokenizer_with_eos

    checkpoint = tmp_path / "final"
    presets.get("debug").save_pretrained(checkpoint)  # config.json with auto_map, as every checkpoint has
    AutoTokenizer.from_pretrained(tiny_data_dir).save_pretrained(checkpoint)
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "n")
    monkeypatch.delitem(CONFIG_MAPPING._extra_content, "recurrent_depth")  # a process that never imported the model
    AutoTokenizer.from_pretrained(checkpoint)
    assert asked and "custom code" in asked[0]  # what a user of plain transformers sees
    asked.clear()
    assert len(load_tokenizer_with_eos(str(checkpoint))) == 384 and asked == []


def test_plan_memory_names_the_device_its_tokens_per_second_are_for(capsys):
    from trainer_ext.cli.plan_memory import main

    assert main(["--preset", "debug", "--seq_len", "256", "--cap_gib", "24", "--max_batch_size", "2"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "tokens/s" in line]
    assert "speed on NVIDIA H200 (the calibration's device):" in line
