"""Offline distillation: the cache_teacher CLI, trainer_ext.distill.caching and .cache (CPU, tiny models)."""

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

import hf_recurrent  # noqa: F401
from hf_recurrent import presets
from trainer_ext.cli import cache_teacher
from trainer_ext.data.shards import ShardedTokenDataset, read_manifest, write_manifest, write_shard
from trainer_ext.distill.losses import TopKTeacher, chunked_lm_loss
from trainer_ext.distill.cache import (
    TEACHER_MANIFEST_NAME,
    TeacherCacheDataset,
    check_cache_divergence,
    read_teacher_manifest,
    validate_teacher_cache,
    write_teacher_manifest,
)
from trainer_ext.training.arguments import RecurrentTrainingArguments
from trainer_ext.training.trainer import RecurrentTrainer

TOPK = 16
# The tests below check the cached values against the teacher to fp16 precision: the fp16 layout. The compact
# codec's own tests are in tests/test_cache_codec.py.
FP16 = ["--cache_format", "fp16"]
TRAIN_SHARDS = [f"train-{i:05d}.npy" for i in range(4)]


def save_teacher(path, config, tokenizer, head_std=0.3):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    # A wider head than the default init gives a peaked teacher with real tail mass, not a near-uniform one.
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=head_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def data_dir(tiny_data_dir, tmp_path_factory):
    """The first 4 train shards (1,600 samples) and the eval shard of data_dir: less teacher work."""
    out = tmp_path_factory.mktemp("data") / "kjv-4-shards"
    shutil.copytree(tiny_data_dir, out, ignore=lambda _, names: [n for n in names if n.startswith("train-000")
                                                                 and n not in TRAIN_SHARDS])
    manifest = read_manifest(out)
    manifest["splits"]["train"]["shards"] = manifest["splits"]["train"]["shards"][:len(TRAIN_SHARDS)]
    manifest["splits"]["train"]["num_samples"] = sum(s["num_samples"] for s in manifest["splits"]["train"]["shards"])
    write_manifest(str(out), manifest)
    return str(out)


@pytest.fixture(scope="module")
def teacher_dir(data_dir, tmp_path_factory):
    """A tiny Llama teacher whose head is padded past the tokenizer (384 entries -> 448 logits)."""
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    config = presets.get("transformer-debug", vocab_size=len(tokenizer) + 64)
    assert config.vocab_size > len(tokenizer)
    path = tmp_path_factory.mktemp("teacher") / "llama"
    save_teacher(path, config, tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def cache_dir(data_dir, teacher_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cache") / "topk")
    cache_teacher.main(["--teacher_model_name_or_path", teacher_dir, "--data_dir", data_dir,
                        "--output_dir", out, "--topk", str(TOPK), "--batch_size", "128",
                        "--position_chunk_size", "1000", *FP16])
    return out


def full_teacher_logprobs(teacher_dir, input_ids, vocab_limit, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids, **kwargs).logits  # (B, T, V_t)
    return F.log_softmax(logits[..., :vocab_limit].double(), dim=-1)


def shard_inodes(cache):
    return {name: os.stat(os.path.join(cache, name)).st_ino for name in os.listdir(cache) if name.endswith(".npy")}


def test_cache_shards_are_aligned_with_token_shards(data_dir, cache_dir):
    data_manifest = read_manifest(data_dir)
    manifest = validate_teacher_cache(cache_dir, data_dir)
    assert set(manifest["splits"]) == {"train", "eval"}
    data_hash = data_manifest["tokenizer_hash"]
    assert manifest["data"]["tokenizer_hash"] == manifest["teacher"]["tokenizer_hash"] == data_hash
    assert manifest["teacher_details"]["logits_size"] == 448 and manifest["data"]["vocab_size"] == 384
    for split in ("train", "eval"):
        token_shards = data_manifest["splits"][split]["shards"]
        cache_shards = manifest["splits"][split]["shards"]
        assert [s["file"] for s in token_shards] == [s["token_file"] for s in cache_shards]
        for token, cached in zip(token_shards, cache_shards):
            assert cached["token_sha256"] == token["sha256"]
            stem = token["file"].removesuffix(".npy")
            ids = np.load(os.path.join(cache_dir, stem + ".topk_ids.npy"))
            logprobs = np.load(os.path.join(cache_dir, stem + ".topk_logprobs.npy"))
            assert ids.shape == logprobs.shape == (token["num_samples"], 32, TOPK)
            assert ids.dtype == np.uint16 and logprobs.dtype == np.float16
            assert ids.max() < 384  # head padding (ids 384..447) never appears
            assert (np.diff(logprobs.astype(np.float32), axis=-1) <= 0).all()  # sorted, most likely first
            tail = 1 - np.exp(logprobs.astype(np.float64)).sum(-1)
            assert tail.min() > -2e-3 and tail.max() < 1 and tail.mean() > 0.01  # a real tail bucket


def test_cached_topk_equals_the_teachers_topk(data_dir, teacher_dir, cache_dir):
    tokens = ShardedTokenDataset(data_dir, "train")
    data = TeacherCacheDataset(tokens, cache_dir)
    indices = [0, 399, 400, 1234, len(data) - 1]  # across shard boundaries
    batch = default_data_collator([data[i] for i in indices])
    assert batch["teacher_topk_ids"].dtype == torch.int64 and batch["teacher_topk_logprobs"].dtype == torch.float32
    assert torch.equal(batch["input_ids"], torch.stack([tokens[i]["input_ids"] for i in indices]))
    reference = full_teacher_logprobs(teacher_dir, batch["input_ids"], 384)
    ref_values, ref_ids = reference.topk(TOPK, dim=-1)
    cached_ids, cached_lp = batch["teacher_topk_ids"], batch["teacher_topk_logprobs"].double()
    # The cached ids carry exactly the teacher's log-probs (up to fp16 storage) and those are its top k.
    torch.testing.assert_close(cached_lp, reference.gather(-1, cached_ids), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(cached_lp, ref_values, rtol=1e-3, atol=1e-3)
    assert (cached_ids == ref_ids).double().mean() > 0.99


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_offline_loss_equals_naive_full_logit_loss_on_the_same_support(
        data_dir, teacher_dir, cache_dir, temperature):
    data = TeacherCacheDataset(ShardedTokenDataset(data_dir, "eval"), cache_dir)
    batch = default_data_collator([data[i] for i in range(8)])
    input_ids, labels = batch["input_ids"], batch["shift_labels"]
    torch.manual_seed(1)
    student = AutoModelForCausalLM.from_config(presets.get("debug", vocab_size=384)).eval()
    with torch.no_grad():
        hidden = student.model(input_ids=input_ids, num_steps=2).last_hidden_state
    weight = student.lm_head.weight.detach()
    alpha = 0.5
    offline = chunked_lm_loss(hidden, weight, labels, alpha=alpha, temperature=temperature, chunk_size=50,
                              teacher=TopKTeacher(batch["teacher_topk_ids"], batch["teacher_topk_logprobs"]))

    # Naive reference in float64 from the full teacher distribution, restricted to its own top k + a tail.
    t_lp = full_teacher_logprobs(teacher_dir, input_ids, 384).flatten(0, 1)  # (N, 384)
    s_logits = (hidden.double() @ weight.double().T).flatten(0, 1)
    ce = F.cross_entropy(s_logits, labels.flatten())
    t_top, ids = t_lp.topk(TOPK, dim=-1)
    mass = t_top.exp().sum(-1, keepdim=True)
    t_probs = torch.cat([mass * F.softmax(t_top / temperature, -1), 1 - mass], -1)
    s_top = F.softmax(s_logits / temperature, -1).gather(1, ids)
    s_probs = torch.cat([s_top, 1 - s_top.sum(-1, keepdim=True)], -1)
    kd = (t_probs * (t_probs.log() - s_probs.log())).sum(-1).mean()
    loss = (1 - alpha) * ce + alpha * temperature**2 * kd

    assert kd > 0.05  # the teacher and the student really differ: agreement below is not trivial
    assert float(offline.ce) == pytest.approx(float(ce), rel=1e-5)
    assert float(offline.kd) == pytest.approx(float(kd), rel=1e-4)  # fp16 storage costs ~1e-6 here
    assert float(offline.loss) == pytest.approx(float(loss), rel=1e-4)


def test_resume_recomputes_only_missing_or_damaged_shards(data_dir, teacher_dir, cache_dir, tmp_path):
    cache = str(tmp_path / "cache")
    shutil.copytree(cache_dir, cache)
    before = shard_inodes(cache)
    reference = np.load(os.path.join(cache, "train-00001.topk_logprobs.npy"))
    manifest = read_teacher_manifest(cache)
    manifest["splits"]["train"]["shards"] = [s for s in manifest["splits"]["train"]["shards"]
                                             if s["token_file"] != "train-00001.npy"]  # as if killed before it
    write_teacher_manifest(cache, manifest)
    with open(os.path.join(cache, "train-00002.topk_ids.npy"), "r+b") as f:
        f.truncate(1000)  # an interrupted copy
    with pytest.raises(ValueError, match="incomplete"):
        validate_teacher_cache(cache, data_dir)

    args = ["--teacher_model_name_or_path", teacher_dir, "--data_dir", data_dir, "--output_dir", cache, *FP16,
            "--topk", str(TOPK), "--batch_size", "128"]
    cache_teacher.main(args)
    after = shard_inodes(cache)
    changed = sorted(name for name in before if before[name] != after[name])
    assert changed == ["train-00001.topk_ids.npy", "train-00001.topk_logprobs.npy",
                       "train-00002.topk_ids.npy", "train-00002.topk_logprobs.npy"]
    np.testing.assert_array_equal(np.load(os.path.join(cache, "train-00001.topk_logprobs.npy")), reference)
    validate_teacher_cache(cache, data_dir)
    assert not [n for n in os.listdir(cache) if n.endswith(".tmp")]

    cache_teacher.main(args)  # complete: nothing is recomputed
    assert shard_inodes(cache) == after
    with pytest.raises(ValueError, match="--overwrite"):
        cache_teacher.main(args[:-4] + ["--topk", "8"])


def test_teacher_with_another_tokenizer_is_refused_before_any_work(data_dir, teacher_dir, tmp_path):
    other = tmp_path / "other-teacher"
    shutil.copytree(teacher_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    data_hash = read_manifest(data_dir)["tokenizer_hash"]
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    from trainer_ext.data.shards import tokenizer_hash
    other_hash = tokenizer_hash(AutoTokenizer.from_pretrained(other))
    assert other_hash != data_hash
    out = tmp_path / "cache"
    with pytest.raises(ValueError) as err:
        cache_teacher.main(["--teacher_model_name_or_path", str(other), "--data_dir", data_dir,
                            "--output_dir", str(out)])
    assert data_hash in str(err.value) and other_hash in str(err.value)
    assert not out.exists() or not os.listdir(out)


def test_cache_of_other_token_shards_or_tokenizer_is_refused(data_dir, teacher_dir, cache_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    manifest = read_manifest(data)
    old_entry = manifest["splits"]["train"]["shards"][0]
    rows = np.load(data / old_entry["file"])
    new_entry = write_shard(str(data / old_entry["file"]), rows[::-1])  # same tokens, another order
    manifest["splits"]["train"]["shards"][0] = new_entry
    write_manifest(str(data), manifest)
    with pytest.raises(ValueError) as err:
        TeacherCacheDataset(ShardedTokenDataset(str(data), "train"), cache_dir)
    assert old_entry["sha256"] in str(err.value) and new_entry["sha256"] in str(err.value)
    TeacherCacheDataset(ShardedTokenDataset(str(data), "eval"), cache_dir)  # the untouched split still fits

    # Rerunning cache_teacher against the changed data recomputes exactly the changed shard.
    cache = str(tmp_path / "cache")
    shutil.copytree(cache_dir, cache)
    before = shard_inodes(cache)
    cache_teacher.main(["--teacher_model_name_or_path", teacher_dir, "--data_dir", str(data), "--output_dir", cache,
                        "--topk", str(TOPK), "--batch_size", "128", *FP16])
    after = shard_inodes(cache)
    assert sorted(n for n in before if before[n] != after[n]) == ["train-00000.topk_ids.npy",
                                                                  "train-00000.topk_logprobs.npy"]
    # Same samples in reverse order: the same teacher outputs, reversed (batching may move the last bits).
    recomputed, original = (np.load(os.path.join(c, "train-00000.topk_logprobs.npy")) for c in (cache, cache_dir))
    np.testing.assert_allclose(recomputed.astype(np.float32), original[::-1].astype(np.float32), atol=1e-2)
    TeacherCacheDataset(ShardedTokenDataset(str(data), "train"), cache)

    manifest["tokenizer_hash"] = "f" * 64
    write_manifest(str(data), manifest)
    with pytest.raises(ValueError) as err:
        validate_teacher_cache(cache_dir, str(data))
    assert "f" * 64 in str(err.value) and read_teacher_manifest(cache_dir)["data"]["tokenizer_hash"] in str(err.value)


def test_recurrent_teacher_is_cached_at_the_requested_depth(data_dir, teacher_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    path = tmp_path / "recurrent-teacher"
    save_teacher(path, presets.get("debug", vocab_size=len(tokenizer)), tokenizer, head_std=1.0)
    out = str(tmp_path / "cache")
    cache_teacher.main(["--teacher_model_name_or_path", str(path), "--data_dir", data_dir, "--output_dir", out,
                        "--splits", "eval", "--topk", "8", "--num_steps", "2", *FP16])
    assert read_teacher_manifest(out)["teacher"]["num_steps"] == 2
    data = TeacherCacheDataset(ShardedTokenDataset(data_dir, "eval"), out)
    batch = default_data_collator([data[i] for i in range(len(data))])
    at_2 = full_teacher_logprobs(str(path), batch["input_ids"], 384, num_steps=2)
    at_4 = full_teacher_logprobs(str(path), batch["input_ids"], 384, num_steps=4)
    cached = batch["teacher_topk_logprobs"].double()
    torch.testing.assert_close(cached, at_2.topk(8, dim=-1).values, rtol=1e-3, atol=1e-3)
    assert (cached - at_4.topk(8, dim=-1).values).abs().max() > 0.05  # depth really mattered

    with pytest.raises(ValueError, match="num_steps"):  # a plain Transformer has no depth to set
        cache_teacher.main(["--teacher_model_name_or_path", teacher_dir, "--data_dir", data_dir,
                            "--output_dir", str(tmp_path / "llama"), "--splits", "eval", "--num_steps", "2"])


def test_recurrent_trainer_distills_from_the_cache(data_dir, cache_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(presets.get("debug", vocab_size=len(tokenizer)))
    args = RecurrentTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, dataloader_pin_memory=False, disable_tqdm=True, use_cpu=True,
        profile_steps=0,
        # The Trainer drops batch keys that model.forward does not name, the teacher keys included.
        remove_unused_columns=False)
    trainer = RecurrentTrainer(
        model=model, args=args, processing_class=tokenizer,
        train_dataset=TeacherCacheDataset(ShardedTokenDataset(data_dir, "train"), cache_dir),
        eval_dataset=TeacherCacheDataset(ShardedTokenDataset(data_dir, "eval"), cache_dir))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 4
    assert all(math.isfinite(e["kd"]) and e["kd"] > 0 for e in logs)
    # loss = (1 - alpha) * ce + alpha * kd at T = 1: the cache really entered the loss.
    assert all(e["loss"] == pytest.approx(0.5 * e["ce"] + 0.5 * e["kd"], abs=2e-3) for e in logs)
    assert math.isfinite(trainer.evaluate()["eval_loss"])


def test_cache_manifest_is_json_tying_data_and_teacher(cache_dir, teacher_dir):
    with open(os.path.join(cache_dir, TEACHER_MANIFEST_NAME)) as f:
        manifest = json.load(f)
    assert manifest["teacher"]["name_or_path"] == teacher_dir and manifest["topk"] == TOPK
    assert manifest["data"]["seq_len"] == 32 and manifest["ids_dtype"] == "uint16"
    assert manifest["teacher_details"]["model_type"] == "llama"


def test_quantized_teacher_needs_cuda_and_a_known_mode(data_dir, teacher_dir, tmp_path):
    args = ["--teacher_model_name_or_path", teacher_dir, "--data_dir", data_dir, "--output_dir", str(tmp_path / "q"),
            "--device", "cpu"]
    with pytest.raises(ValueError, match="--quantization='2bit' is not allowed"):
        cache_teacher.main(args + ["--quantization", "2bit"])
    with pytest.raises(ValueError, match="--quantization 4bit needs a CUDA device"):
        cache_teacher.main(args + ["--quantization", "4bit"])


def test_the_quantized_teacher_benchmark_caches_the_eval_split_and_leaves_its_rows(data_dir, tmp_path):
    from benchmarks import teacher_quant

    output = tmp_path / "tq.jsonl"
    assert teacher_quant.main(["--data_dir", data_dir, "--shapes", "tiny", "--quantizations", "none", "--output",
                               str(output), "--work_dir", str(tmp_path / "work")]) == 0
    (row,) = [json.loads(line) for line in output.read_text().splitlines()]
    eval_split = read_manifest(data_dir)["splits"]["eval"]
    assert row["shape"] == "tiny" and row["status"] == "ok" and row["quantization"] == "none"
    assert row["tokens"] == eval_split["num_samples"] * read_manifest(data_dir)["seq_len"]
    assert row["tokens_per_second"] > 0 and row["load_seconds"] >= 0 and row["params"] > 0
    assert os.listdir(tmp_path / "work") == []  # the teacher and its cache removed once measured
    assert "| tiny | " in (tmp_path / "tq.md").read_text()


@pytest.fixture(scope="module")
def compact_cache_dir(data_dir, teacher_dir, tmp_path_factory):
    """The same teacher cached with the default (compact) codec."""
    out = str(tmp_path_factory.mktemp("cache") / "compact")
    cache_teacher.main(["--teacher_model_name_or_path", teacher_dir, "--data_dir", data_dir, "--output_dir", out,
                        "--topk", str(TOPK), "--batch_size", "128"])
    return out


def test_the_compact_cache_serves_the_same_ids_head_and_tail_in_fewer_bytes(data_dir, cache_dir, compact_cache_dir):
    manifest = read_teacher_manifest(compact_cache_dir)
    assert manifest["format_version"] == 2 and manifest["codec"]["name"] == "compact"
    # 16 ids of 9 bits (18 bytes) + 3 exact log-probs, 2 coefficients and the tail in fp16 (12 bytes)
    assert manifest["bytes_per_token"] == 30 < read_teacher_manifest(cache_dir)["bytes_per_token"] == 64
    entry = manifest["splits"]["train"]["shards"][0]
    on_disk = entry["ids_size_bytes"] + entry["logprobs_size_bytes"]
    assert on_disk == pytest.approx(30 * entry["num_samples"] * 32, abs=512)  # the .npy headers
    tokens = ShardedTokenDataset(data_dir, "train")
    compact, exact = TeacherCacheDataset(tokens, compact_cache_dir), TeacherCacheDataset(tokens, cache_dir)
    for index in (0, 401, len(tokens) - 1):
        got, want = compact[index], exact[index]
        assert torch.equal(got["teacher_topk_ids"], want["teacher_topk_ids"])
        torch.testing.assert_close(got["teacher_topk_logprobs"][:, :3], want["teacher_topk_logprobs"][:, :3],
                                   rtol=0, atol=2e-3)
        tails = [1 - item["teacher_topk_logprobs"].double().exp().sum(-1) for item in (got, want)]
        torch.testing.assert_close(tails[0], tails[1], rtol=0, atol=3e-3)


def test_a_version_1_cache_still_reads(data_dir, cache_dir, tmp_path):
    """Caches written before the compact codec (format version 1: no codec, no file checksums) read as fp16."""
    old = str(tmp_path / "v1")
    shutil.copytree(cache_dir, old)
    manifest = read_teacher_manifest(old)
    manifest["format_version"] = 1
    for key in ("codec", "bytes_per_token"):
        del manifest[key]
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            del entry["ids_sha256"], entry["logprobs_sha256"]
    write_teacher_manifest(old, manifest)
    tokens = ShardedTokenDataset(data_dir, "eval")
    got, want = TeacherCacheDataset(tokens, old)[3], TeacherCacheDataset(tokens, cache_dir)[3]
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_a_cache_file_changed_after_writing_is_refused_before_training(data_dir, cache_dir, tmp_path):
    """Log-probs overwritten with +5.0 (ids set past the vocabulary alike): the sha256 recorded at writing catches
    it before training, naming the file; read without the checksums, the range check names it at the sample."""
    cache = str(tmp_path / "cache")
    shutil.copytree(cache_dir, cache)
    path = os.path.join(cache, "eval-00000.topk_logprobs.npy")
    logprobs = np.load(path, mmap_mode="r+")
    logprobs[2, 5, :] = 5.0
    logprobs.flush()
    del logprobs
    tokens = ShardedTokenDataset(data_dir, "eval")
    with pytest.raises(ValueError, match="eval-00000.topk_logprobs.npy: sha256 differs.*hf-recurrent-cache-teacher"):
        TeacherCacheDataset(tokens, cache)
    unchecked = TeacherCacheDataset(tokens, cache, verify_checksums=False)
    unchecked[1]  # an intact sample reads
    with pytest.raises(ValueError, match="eval-00000.topk_logprobs.npy, sample 2: log-probs above 0"):
        unchecked[2]
    ids = np.load(os.path.join(cache, "eval-00000.topk_ids.npy"), mmap_mode="r+")
    ids[1, 0, 0] = 65000
    ids.flush()
    del ids
    with pytest.raises(ValueError, match="eval-00000.topk_ids.npy .* sample 1: ids outside \\[0, 384\\)"):
        unchecked[1]
    # a rerun of the cache builder recomputes the damaged shard
    cache_teacher.main(["--teacher_model_name_or_path", read_teacher_manifest(cache)["teacher"]["name_or_path"],
                        "--data_dir", data_dir, "--output_dir", cache, "--topk", str(TOPK), "--batch_size", "128",
                        *FP16])
    TeacherCacheDataset(tokens, cache)[2]


def test_a_cache_that_will_not_fit_on_the_disk_is_refused_before_the_teacher_loads(data_dir, teacher_dir, tmp_path,
                                                                                   monkeypatch, caplog):
    """The comparison's cycles build their caches through the same call: a cycle whose cache will not fit does not
    start. The log states the bytes per token and the disk needed first."""
    import collections

    import trainer_ext.files

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(trainer_ext.files.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**5, 10**5))
    loaded = []
    monkeypatch.setattr("trainer_ext.distill.caching.load_frozen_teacher", lambda *a, **k: loaded.append(a))
    out = tmp_path / "cache"
    with caplog.at_level("INFO", logger="trainer_ext.distill.caching"):
        with pytest.raises(OSError, match="Not enough free space in .* it needs about .* 97.7 KiB free.*--topk"):
            cache_teacher.main(["--teacher_model_name_or_path", teacher_dir, "--data_dir", data_dir,
                                "--output_dir", str(out), "--topk", str(TOPK)])
    assert not loaded and not [n for n in os.listdir(out) if n.endswith(".npy")]
    assert "30 bytes per token (compact codec, k = 16)" in caplog.text


def test_a_sampled_cache_serves_distinct_drawn_ids_and_trains_and_refuses_reverse_kl(data_dir, teacher_dir, tmp_path):
    out = str(tmp_path / "sampled")
    args = ["--teacher_model_name_or_path", teacher_dir, "--data_dir", data_dir, "--output_dir", out,
            "--topk", str(TOPK), "--batch_size", "128", "--teacher_cache_mode", "sampled", "--splits", "eval"]
    with pytest.raises(ValueError, match="--cache_format fp16 stores top-k log-probs.*drop --cache_format fp16"):
        cache_teacher.main(args + FP16)
    cache_teacher.main(args)
    manifest = read_teacher_manifest(out)
    # 16 ids of 9 bits (18 bytes) + 16 counts of 5 bits (10 bytes)
    assert manifest["codec"]["name"] == "sampled" and manifest["bytes_per_token"] == 28 and manifest["seed"] == 0
    tokens = ShardedTokenDataset(data_dir, "eval")
    cached = TeacherCacheDataset(tokens, out)
    item = cached[3]
    ids, logprobs = item["teacher_topk_ids"], item["teacher_topk_logprobs"]
    assert all(len(set(row.tolist())) == TOPK for row in ids)
    assert torch.all((logprobs.double().exp() * TOPK).round().sum(-1) == TOPK)
    # The draws follow the teacher: the drawn ids' total teacher probability is far above that of random ids.
    teacher_lp = full_teacher_logprobs(teacher_dir, item["input_ids"][None], len(AutoTokenizer.from_pretrained(
        data_dir)))[0]
    drawn_mass = (teacher_lp.gather(-1, ids).exp() * (logprobs > -1e3)).sum(-1).mean()
    assert drawn_mass > 0.5, drawn_mass
    loss = chunked_lm_loss(torch.randn(1, 32, 8), torch.randn(len(AutoTokenizer.from_pretrained(data_dir)), 8),
                           item["labels"][None] if "labels" in item else item["shift_labels"][None],
                           teacher=TopKTeacher(ids=ids[None], logprobs=logprobs[None]), alpha=1.0)
    assert math.isfinite(float(loss.kd)) and float(loss.kd) > 0
    with pytest.raises(ValueError, match="sampled cache.*--distill_divergence forward_kl or jsd"):
        check_cache_divergence(manifest, out, "reverse_kl")
    check_cache_divergence(manifest, out, "jsd")
    check_cache_divergence(read_teacher_manifest(out), out, "forward_kl")


def test_a_cache_is_decoded_ahead_by_worker_processes_with_the_same_losses(data_dir, compact_cache_dir, tmp_path,
                                                                           monkeypatch):
    from trainer_ext.cli import run_pretrain
    from trainer_ext.run.job import TrainingJob
    from trainer_ext.run.pretrain import parse_pretrain_args

    args = ["--data_dir", data_dir, "--teacher_cache_dir", compact_cache_dir, "--max_steps", "3", "--logging_steps",
            "1", "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false", "--max_eval_samples", "4",
            "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--warmup_steps", "0"]

    def workers(*more, gpu=False, command=args):
        parsed = parse_pretrain_args(command + ["--output_dir", str(tmp_path / "parse"), *more])  # set up on the CPU
        with monkeypatch.context() as patch:
            if gpu:  # the job as it is decided where the training runs on a GPU
                patch.setattr(RecurrentTrainingArguments, "device", property(lambda self: torch.device("cuda")))
            chosen = TrainingJob.resolve(*parsed).training_args
        return chosen.dataloader_num_workers, chosen.dataloader_persistent_workers

    assert workers(gpu=True) == (2, True)  # the default with a cache, on a GPU
    assert workers("--teacher_cache_workers", "0", gpu=True) == (0, False)
    assert workers("--dataloader_num_workers", "1", gpu=True) == (1, False)  # the data loader's own setting wins
    assert workers(gpu=True, command=args[:2] + args[4:]) == (0, False)  # token shards: read in the training process
    assert workers() == (0, False)  # on a CPU nothing runs beside the training to overlap
    with pytest.raises(ValueError, match="--teacher_cache_workers"):
        workers("--teacher_cache_workers", "-1")
    losses = {}
    for name, more in (("in_process", []), ("ahead", ["--dataloader_num_workers", "2"])):
        assert run_pretrain.main(args + ["--output_dir", str(tmp_path / name), *more]) == 0
        with open(tmp_path / name / "log_history.json") as f:
            losses[name] = [(e["loss"], e["kd"]) for e in json.load(f) if "loss" in e]
    assert len(losses["ahead"]) == 3 and losses["ahead"] == losses["in_process"]
