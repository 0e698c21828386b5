"""Failures that used to pass silently: a collapsed model, skipped or non-finite steps, corrupt shards, decoding
replacements and memory-hungry long documents. CPU, seconds each."""

import itertools
import logging
import math

import pytest

from trainer_ext.training.stability import UnstableTrainingError

from test_stability import NAN, inject
from test_trainer import make_trainer


# ----------------------------------------------------------------------------- collapse and skipped steps


def test_a_collapsed_model_stops_training_with_the_fix(tiny_data_dir, tmp_path, caplog):
    # At this rate the first update sends the model to uniform predictions (loss ln V) while the optimizer skips
    # tensors with non-finite gradients every step: before, a 12-step run exited normally.
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=12, learning_rate=1e6, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger="trainer_ext.training.trainer"):
        with pytest.raises(UnstableTrainingError, match="collapsed to uniform predictions") as raised:
            trainer.train()
    message = str(raised.value)
    assert "--learning_rate" in message and "hf-recurrent-find-lr" in message
    assert f"ln(vocab_size) = {math.log(trainer.model.config.vocab_size):.4f}" in message
    assert trainer.state.global_step < 12  # stopped before the end
    assert any(r.levelno == logging.ERROR and "collapsed" in r.getMessage() for r in caplog.records)
    assert any("the optimizer skipped" in r.getMessage() and "non-finite gradients" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_a_healthy_run_is_not_taken_for_a_collapse(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=12, save_strategy="no", collapse_check_steps=3)
    trainer.train()
    assert trainer.state.global_step == 12


def test_the_collapse_check_can_be_turned_off_and_is_validated(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=12, learning_rate=1e6, save_strategy="no",
                           collapse_check_steps=0)
    trainer.train()
    assert trainer.state.global_step == 12
    with pytest.raises(ValueError, match="--collapse_margin=0"):
        make_trainer(tiny_data_dir, tmp_path, collapse_margin=0)
    with pytest.raises(ValueError, match="--collapse_check_steps=-1"):
        make_trainer(tiny_data_dir, tmp_path, collapse_check_steps=-1)


@pytest.mark.parametrize("optimizer", ["low_memory", "hf"])
def test_a_non_finite_step_is_logged_as_nan_without_the_guard(tiny_data_dir, tmp_path, optimizer):
    # Without the stability guard the Trainer's NaN filter used to log such a step as `loss: 0.0`.
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=3, save_strategy="no", stability_guard=False,
                           optimizer=optimizer, optim="adamw_torch")
    inject(trainer, {1: NAN})
    trainer.train()
    logs = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    assert math.isnan(logs[1]["loss"]) and logs[1]["nonfinite_losses"] == 1
    assert all(entry["loss"] != 0.0 for entry in logs.values())
    if optimizer == "low_memory":  # the optimizer skipped every tensor: logged as such, the next step is healthy
        assert logs[1]["skipped_updates"] > 0 and math.isfinite(logs[2]["loss"])


# ----------------------------------------------------------------------------- corrupt shards


def corrupt_copy(data_dir, tmp_path, change):
    """A copy of `data_dir` whose first train shard has one token changed by `change(id) -> id`."""
    import shutil

    import numpy as np

    from trainer_ext.data.shards import read_npy_header

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    shard = copy / "train-00000.npy"
    _, dtype, _, offset = read_npy_header(str(shard))
    position = offset + 10 * dtype.itemsize  # the 11th token of the first sample
    raw = bytearray(shard.read_bytes())
    token = int(np.frombuffer(bytes(raw[position:position + dtype.itemsize]), dtype=dtype)[0])
    raw[position:position + dtype.itemsize] = np.array([change(token)], dtype=dtype).tobytes()
    shard.write_bytes(bytes(raw))  # same size, same header: only the hash can tell
    return copy, shard


def test_a_flipped_byte_with_ids_in_range_is_caught_by_the_checksum(tiny_data_dir, tmp_path, caplog):
    from trainer_ext.data.shards import ShardedTokenDataset, read_manifest

    vocab_size = read_manifest(tiny_data_dir)["vocab_size"]
    copy, shard = corrupt_copy(tiny_data_dir, tmp_path, lambda token: token ^ 1)
    with pytest.raises(ValueError, match="sha256 differs") as raised:
        ShardedTokenDataset(str(copy), "train", model_vocab_size=vocab_size)
    assert str(shard) in str(raised.value) and "corrupt" in str(raised.value)
    ShardedTokenDataset(str(copy), "train", verify_checksums=False)  # the way out for huge corpora


def test_the_checksum_check_says_that_it_ran_and_runs_once_per_file(tiny_data_dir, tmp_path, caplog):
    import shutil

    from trainer_ext.data.shards import ShardedTokenDataset

    copy = tmp_path / "data"
    shutil.copytree(tiny_data_dir, copy)
    with caplog.at_level(logging.INFO, logger="trainer_ext.data.shards"):
        ShardedTokenDataset(str(copy), "train")
        ShardedTokenDataset(str(copy), "train")
    lines = [r.getMessage() for r in caplog.records if "sha256" in r.getMessage()]
    assert len(lines) == 1 and "train shard(s)" in lines[0] and " s (verify_checksums=False" in lines[0]


def test_an_id_past_the_vocabulary_is_reported_as_corruption_naming_the_file(tiny_data_dir, tmp_path):
    from trainer_ext.data.shards import ShardedTokenDataset, read_manifest

    vocab_size = read_manifest(tiny_data_dir)["vocab_size"]
    copy, shard = corrupt_copy(tiny_data_dir, tmp_path, lambda token: token | 0xFF00)
    with pytest.raises(ValueError, match="corrupt") as raised:
        ShardedTokenDataset(str(copy), "train", model_vocab_size=vocab_size)
    message = str(raised.value)
    assert str(shard) in message and "set the model config's vocab_size" not in message


# ----------------------------------------------------------------------------- prepare_data: decoding, long documents


def test_decoding_replacements_are_counted_and_the_file_is_named(tmp_path, caplog):
    from trainer_ext.cli import prepare_data
    from trainer_ext.data import corpus

    chapters = list(itertools.islice(corpus.iter_default_documents(), 20))
    good, bad = tmp_path / "good.txt", tmp_path / "latin1.txt"
    good.write_text("\n".join(chapters[:10]) + "\n", encoding="utf-8")
    # Three bytes that are not UTF-8 (cp1252 quotes and an e-acute), and one U+FFFD that is real text.
    bad.write_bytes(("\n".join(chapters[10:]) + "\n").encode() + b"caf\xe9 \x93quoted\x94 \xef\xbf\xbd\n")
    assert corpus.count_decoding_replacements(str(bad)) == 3 and corpus.count_decoding_replacements(str(good)) == 0
    with caplog.at_level(logging.WARNING, logger="trainer_ext.data.corpus"):
        prepare_data.main(["--files", str(good), str(bad), "--text_sample_by", "line", "--output_dir",
                           str(tmp_path / "out"), "--vocab_size", "300", "--seq_len", "16", "--eval_samples", "2",
                           "--disable_tqdm"])
    warnings = [r.getMessage() for r in caplog.records if "U+FFFD" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("4 U+FFFD") and f"{bad}: 3" in warnings[0] and str(good) not in warnings[0]


def long_document(repeats: int = 1):
    from trainer_ext.data import corpus

    chapters = list(itertools.islice(corpus.iter_default_documents(), 40))
    separators = ["\n\n", "  ", "\t", " \n ", "   "]  # whitespace runs of all kinds at the cut points
    return "".join(chapter + separators[i % len(separators)] for i, chapter in enumerate(chapters * repeats))


class SpyTokenizer:
    """Delegates to a tokenizer and records how many characters each call was given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.call_chars = []

    def __call__(self, texts, **kwargs):
        self.call_chars.append(sum(map(len, texts)))
        return self.tokenizer(texts, **kwargs)


def test_long_documents_are_tokenized_in_bounded_pieces_with_the_same_tokens(tiny_data_dir, monkeypatch):
    from transformers import AutoTokenizer

    from trainer_ext.data import tokenizer as prepare_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)  # byte-level BPE, as prepare_data trains
    document = long_document()
    assert len(document) > 100_000
    texts = [document, "In the beginning", "", document[:5000]]
    whole = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    expected = [ids + [tokenizer.eos_token_id] if ids else [] for ids in whole]
    monkeypatch.setattr(prepare_tokenizer, "MAX_ENCODE_CHARS", 4096)
    spy = SpyTokenizer(tokenizer)
    encoded = prepare_tokenizer.encode_documents(spy, texts, tokenizer.eos_token_id)
    assert [ids.tolist() for ids in encoded] == expected
    assert max(spy.call_chars) <= 4096 and sum(spy.call_chars) == sum(map(len, texts))


def test_split_long_text_cuts_before_a_word_and_keeps_every_character():
    from trainer_ext.data.tokenizer import split_long_text

    document = long_document()
    pieces = split_long_text(document, 1000)
    assert "".join(pieces) == document and all(0 < len(piece) <= 1000 for piece in pieces)
    assert all(piece[0].isspace() and not piece[1].isspace() for piece in pieces[1:])
    unspaced = "天地創造" * 1000  # no whitespace: cut at the limit
    assert [len(piece) for piece in split_long_text(unspaced, 1500)] == [1500, 1500, 1000]


def test_the_collapse_check_waits_for_the_end_of_the_warm_up(tiny_data_dir, tmp_path):
    # The same collapsing rate, but every step inside the warm-up: the check has nothing to judge yet.
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=12, learning_rate=1e6, save_strategy="no",
                           warmup_steps=20)
    trainer.train()
    assert trainer.state.global_step == 12
