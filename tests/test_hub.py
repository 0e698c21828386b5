"""Model cards and Hub pushes, end to end against a local Hub-API server (tests/hub_server.py) with the real
huggingface_hub client; a fresh process without this package loads the pushed checkpoint."""

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_recurrent import presets
from hf_recurrent.cost import parameter_counts, tokens_per_optimizer_step
from hub_server import HubTestServer
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.hub.callbacks import HubPushCallback
from trainer_ext.hub.model_card import ModelCardInfo, render_model_card, write_model_card
from trainer_ext.hub.push import BackgroundPusher, HubPushError, cycle_commit_message, push_checkpoint
from trainer_ext.training.arguments import RecurrentTrainingArguments
from trainer_ext.training.trainer import RecurrentTrainer

TOKEN = "hf_" + hashlib.sha256(os.urandom(16)).hexdigest()[:34]  # a fresh secret per run, to grep for
REPO = "test-org/tiny-recurrent"
INPUT_IDS = [[5, 17, 42, 99, 7, 3, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.fixture
def hub(monkeypatch):
    with HubTestServer(token=TOKEN) as server:
        # Requests the client makes on its own (not through our `endpoint`) go to the test server too.
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", server.endpoint)
        yield server


@pytest.fixture(scope="module")
def checkpoint(tiny_data_dir, tmp_path_factory):
    """A saved debug checkpoint (weights, config with auto_map, modeling code, tokenizer, card) and its model."""
    path = str(tmp_path_factory.mktemp("ckpt") / "cycle-1")
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(presets.get("debug", vocab_size=len(tokenizer))).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    write_model_card(path, model, ModelCardInfo(repo_id=REPO, preset="debug", tokens_seen=12_345))
    return path, model


def tree_state(path):
    """Every file under `path` with its bytes' hash and modification time: to prove nothing was touched."""
    state = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                state[os.path.relpath(full, path)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(full).st_mtime_ns)
    return state


def files_containing(path, needle: bytes):
    hits = []
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                if needle in f.read():
                    hits.append(os.path.join(root, name))
    return hits


# -- model card


def test_card_has_metadata_depth_usage_and_eval_table():
    config = presets.get("debug")
    info = ModelCardInfo(repo_id="me/r-debug", preset="debug", language="ja", datasets=["uonlp/CulturaX"],
                         tokens_seen=400_000_000, teacher="llm-jp/llm-jp-3-13b", base_model="me/r-debug-init",
                         eval_results={2: {"ce": 3.25, "top1": 0.31}, 4: {"ce": 3.125, "top1": 0.335}},
                         training_details={"optimizer": "factored second moment"})
    text = render_model_card(config, info)
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert front["license"] == "apache-2.0" and front["language"] == ["ja"]
    assert {"recurrent-depth", "distillation"} <= set(front["tags"])
    assert front["datasets"] == ["uonlp/CulturaX"] and front["base_model"] == "me/r-debug-init"
    assert ModelCard(text).data.pipeline_tag == "text-generation"  # the Hub client's own parser agrees
    # Loading and depth instructions, with the config's default depth.
    assert 'AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)' in text
    assert 'AutoTokenizer.from_pretrained(repo, trust_remote_code=True)' in text  # no [y/N] prompt on a terminal
    assert f"num_steps={config.mean_recurrence}" in text and 'repo = "me/r-debug"' in text
    counts = parameter_counts(config)
    assert f"{counts.unique:,}" in text and counts.per_step > 0
    assert "1 / 2 / 1" in text  # prelude / core / coda
    assert "| block normalisation | `sandwich` |" in text
    # The evaluation table, one row per depth, and the training facts.
    assert "| depth | ce | top1 |" in text and "| 2 | 3.25 | 0.31 |" in text and "| 4 | 3.125 | 0.335 |" in text
    assert "400,000,000 (400M)" in text and "llm-jp/llm-jp-3-13b" in text and "factored second moment" in text
    assert "$" not in text.replace("$$", "")  # every template placeholder was filled


def test_the_usage_snippet_prompts_in_the_language_of_the_data(tmp_path):
    import json

    from trainer_ext.data.prepare import PrepareDataArguments, prepare
    from trainer_ext.hub.model_card import data_prompt

    documents = [f"第{i}章 大規模言語モデルの学習は、限られたGPUで最大の効率を目指す。" * 3 for i in range(60)]
    (tmp_path / "ja.jsonl").write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in documents),
                                       encoding="utf-8")
    data = tmp_path / "data"
    prepare(PrepareDataArguments(files=[str(tmp_path / "ja.jsonl")], output_dir=str(data), vocab_size=400, seq_len=64,
                                 eval_samples=8, disable_tqdm=True))
    prompt = data_prompt(str(data))
    assert prompt and len(prompt) <= 40 and prompt.startswith("第") and prompt[1:prompt.index("章")].isdigit()
    card = render_model_card(presets.get("debug"), ModelCardInfo(example_prompt=prompt))
    assert f'inputs = tokenizer("{prompt}", return_tensors="pt")' in card
    assert 'tokenizer("In the beginning"' in render_model_card(presets.get("debug"))  # no data: the default
    assert data_prompt(str(tmp_path / "nothing")) is None
    # The same folder prepared again from other text (as --overwrite does) is read again, not taken from before.
    (tmp_path / "ja.jsonl").write_text("".join(json.dumps({"text": f"第{i}節 別の文書です。" * 9}, ensure_ascii=False)
                                               + "\n" for i in range(60)), encoding="utf-8")
    shutil.rmtree(data)
    prepare(PrepareDataArguments(files=[str(tmp_path / "ja.jsonl")], output_dir=str(data), vocab_size=400, seq_len=64,
                                 eval_samples=8, disable_tqdm=True))
    again = data_prompt(str(data))
    assert again and again.startswith("第") and "節" in again and again != prompt


def test_card_variants_and_validation(tmp_path):
    table = "| depth | ppl |\n|---|---|\n| 8 | 12.5 |"
    text = render_model_card(presets.get("debug"), ModelCardInfo(eval_results=table, base_model=str(tmp_path)))
    assert table in text
    assert "base_model" not in yaml.safe_load(text.split("---\n")[1])  # a local path is no Hub reference
    baseline = render_model_card(presets.get("transformer-debug"), ModelCardInfo(preset="transformer-debug"))
    assert "num_steps" not in baseline and "trust_remote_code" not in baseline
    assert "transformer-baseline" in yaml.safe_load(baseline.split("---\n")[1])["tags"]
    with pytest.raises(ValueError, match="tokens_seen"):
        ModelCardInfo(tokens_seen=-1)
    with pytest.raises(ValueError, match="eval_results"):
        ModelCardInfo(eval_results=[1, 2])
    with pytest.raises(ValueError, match="config.json"):
        write_model_card(str(tmp_path))


def test_card_written_from_saved_config_and_template_found_without_package(tmp_path, monkeypatch):
    presets.get("debug").save_pretrained(tmp_path)
    path = write_model_card(str(tmp_path), info=ModelCardInfo(tokens_seen=5))
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]  # no temporary file left behind
    first = open(path).read()
    # The templates resolve from the source tree when the package data is not installed (a checkout on PYTHONPATH).
    monkeypatch.setitem(sys.modules, "trainer_ext.hub.model_cards", None)
    assert render_model_card(presets.get("debug"), ModelCardInfo(tokens_seen=5)) == first


# -- pushing


def test_push_then_fresh_process_loads_with_identical_logits(hub, checkpoint, tmp_path):
    path, model = checkpoint
    message = cycle_commit_message(1, 12_345)
    assert message == "cycle 1: 12.3K tokens"
    commit = push_checkpoint(path, REPO, message, token=TOKEN, private=False, endpoint=hub.endpoint)
    assert hub.commit_titles(REPO) == ["initial commit", message]
    files = hub.files(REPO)
    assert {"config.json", "model.safetensors", "modeling_recurrent_depth.py", "configuration_recurrent_depth.py",
            "tokenizer.json", "README.md"} <= set(files)
    assert files["README.md"] == open(os.path.join(path, "README.md"), "rb").read()
    assert commit.oid == hub.repos[REPO].branches["main"]

    script = textwrap.dedent(f"""
        import sys
        sys.modules["hf_recurrent"] = None  # the package must not be needed
        import numpy as np, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained("{REPO}")
        model = AutoModelForCausalLM.from_pretrained("{REPO}", trust_remote_code=True).eval()
        assert "hf_recurrent" not in type(model).__module__
        ids = torch.tensor({INPUT_IDS})
        with torch.no_grad():
            np.save(sys.argv[1], np.stack([model(ids, num_steps=n).logits.numpy() for n in (1, 3)]))
            out = model.generate(ids[:1], num_steps=2, max_new_tokens=3, do_sample=False)
        print("generated", out.shape[1], len(tokenizer))
    """)
    hf_home = tmp_path / "hf_home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH="")
    out_file = tmp_path / "logits.npy"
    result = subprocess.run([sys.executable, "-c", script, str(out_file)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generated 11" in result.stdout
    with torch.no_grad():
        ids = torch.tensor(INPUT_IDS)
        expected = np.stack([model(ids, num_steps=n).logits.numpy() for n in (1, 3)])
    np.testing.assert_array_equal(np.load(out_file), expected)
    # Downloads went through plain HTTP resolve requests (no Xet, no LFS).
    assert any(m == "GET" and re.search(r"/resolve/[^/]+/model.safetensors$", p) for m, p, _ in hub.requests)
    assert not files_containing(hf_home, TOKEN.encode())
    assert set(hub.unrouted) <= {"GET /api/agent-harnesses"}  # the client's optional telemetry only


def test_transient_failures_are_retried_and_local_files_untouched(hub, checkpoint, tmp_path, caplog, monkeypatch):
    path, _ = checkpoint
    before = tree_state(path)
    hub.fail_next("POST", r"^/api/repos/create$", times=2, status=500)
    with caplog.at_level(logging.WARNING, logger="trainer_ext.hub.push"):
        push_checkpoint(path, REPO, "cycle 1", token=TOKEN, endpoint=hub.endpoint, backoff_seconds=0.01)
    creates = [s for m, p, s in hub.requests if p == "/api/repos/create"]
    assert creates == [500, 500, 200]
    assert caplog.text.count("retrying") == 2
    # Without hf_xet the client commits in one request that it does not retry itself: ours does.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_XET", True)
    hub.fail_next("POST", r"/commit/main$", times=1, status=503)
    cycle_2 = shutil.copytree(path, tmp_path / "cycle-2")
    (cycle_2 / "README.md").write_text("a newer card")  # a changed file, so the commit is not a no-op
    push_checkpoint(str(cycle_2), REPO, "cycle 2", token=TOKEN, endpoint=hub.endpoint, backoff_seconds=0.01)
    assert [s for m, p, s in hub.requests if p.endswith("/commit/main")] == [200, 503, 200]
    assert hub.commit_titles(REPO) == ["initial commit", "cycle 1", "cycle 2"]
    assert hub.files(REPO)["README.md"] == b"a newer card"
    # A branch is created from main when missing, and main is left alone.
    push_checkpoint(path, REPO, "cycle 1 again", token=TOKEN, revision="exp-1", endpoint=hub.endpoint)
    assert hub.commit_titles(REPO, "exp-1") == ["initial commit", "cycle 1", "cycle 2", "cycle 1 again"]
    assert hub.commit_titles(REPO) == ["initial commit", "cycle 1", "cycle 2"]
    assert tree_state(path) == before


def test_failed_push_raises_and_changes_nothing(hub, checkpoint):
    path, _ = checkpoint
    before = tree_state(path)
    hub.fail_next("POST", r"^/api/repos/create$", times=10, status=502)
    with pytest.raises(HubPushError, match="after 3 attempts"):
        push_checkpoint(path, REPO, "cycle 1", token=TOKEN, max_retries=2, endpoint=hub.endpoint,
                        backoff_seconds=0.01)
    assert REPO not in hub.repos
    hub.clear_failures()
    # A permanent error (bad request, wrong token) is not retried.
    hub.fail_next("POST", r"/commit/main$", times=1, status=400)
    with pytest.raises(HubPushError, match="BadRequest"):
        push_checkpoint(path, REPO, "cycle 1", token=TOKEN, endpoint=hub.endpoint, backoff_seconds=0.01)
    assert [s for m, p, s in hub.requests if p.endswith("/commit/main")] == [400]
    assert hub.commit_titles(REPO) == ["initial commit"]
    with pytest.raises(HubPushError):
        push_checkpoint(path, REPO, "cycle 1", token="hf_wrong", endpoint=hub.endpoint, backoff_seconds=0.01)
    assert [s for m, p, s in hub.requests if p == "/api/repos/create"][-1] == 401
    assert tree_state(path) == before
    with pytest.raises(ValueError, match="not a directory"):
        push_checkpoint(path + "-missing", REPO, "cycle 1", token=TOKEN, endpoint=hub.endpoint)
    with pytest.raises(ValueError, match="repo_id"):
        push_checkpoint(path, "a/b/c", "cycle 1", token=TOKEN, endpoint=hub.endpoint)


def test_background_pusher_order_coalescing_snapshot_and_errors(hub, checkpoint, tmp_path, caplog):
    path, _ = checkpoint
    dirs = []
    for i in range(3):
        copy = shutil.copytree(path, tmp_path / f"cycle-{i + 1}")
        (copy / "cycle.txt").write_text(str(i + 1))
        dirs.append(str(copy))

    gate = hub.hold_next("POST", r"^/api/repos/create$")
    pusher = BackgroundPusher(REPO, token=TOKEN, endpoint=hub.endpoint, coalesce=True, backoff_seconds=0.01)
    pusher.submit(dirs[0], "cycle 1")
    assert gate.arrived.wait(10)  # the first push is in flight ...
    shutil.rmtree(dirs[0])  # ... and its directory is rotated away meanwhile: the staged links keep it readable
    pusher.submit(dirs[1], "cycle 2")
    pusher.submit(dirs[2], "cycle 3")  # replaces cycle 2, which had not started
    assert pusher.pending == 2
    gate.release()
    assert pusher.wait(timeout=60)
    assert not pusher.errors, pusher.errors
    assert hub.commit_titles(REPO) == ["initial commit", "cycle 1", "cycle 3"]
    assert hub.files(REPO)["cycle.txt"] == b"3"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".hub-push-")]  # staging removed
    assert os.listdir(dirs[1])  # a superseded checkpoint stays on disk

    failing = BackgroundPusher(REPO, token="hf_wrong", endpoint=hub.endpoint, backoff_seconds=0.01)
    before = tree_state(dirs[2])
    failing.submit(dirs[2], "cycle 4")
    assert failing.close(timeout=60)
    assert len(failing.errors) == 1 and failing.errors[0].commit_message == "cycle 4"
    assert tree_state(dirs[2]) == before
    with pytest.raises(RuntimeError, match="after close"):
        failing.submit(dirs[2], "cycle 5")


def test_trainer_push_to_hub_pushes_each_save_with_card_and_keeps_token_out(hub, tiny_data_dir, tmp_path,
                                                                            caplog, capfd):
    caplog.set_level(logging.DEBUG)
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(presets.get("debug", vocab_size=len(tokenizer)))
    out = tmp_path / "run"
    args = RecurrentTrainingArguments(
        output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=4, learning_rate=3e-3,
        report_to="none", dataloader_pin_memory=False, disable_tqdm=True, use_cpu=True, logging_steps=1,
        push_to_hub=True, hub_model_id=REPO, hub_token=TOKEN, hub_strategy="checkpoint")
    train_set = ShardedTokenDataset(tiny_data_dir, "train")
    info = ModelCardInfo(preset="debug", datasets=["kjv"], training_data="120 KJV chapters")
    callback = HubPushCallback.from_training_args(args, info, tokens_per_optimizer_step(args, train_set.seq_len),
                                                  endpoint=hub.endpoint)
    assert args.push_to_hub is False and args.hub_token is None  # the Trainer neither pushes nor pickles it
    trainer = RecurrentTrainer(model=model, args=args, train_dataset=train_set, processing_class=tokenizer,
                               callbacks=[callback])
    trainer.train()

    assert not callback.pusher.errors and callback.pusher.pending == 0
    titles = hub.commit_titles(REPO)
    assert titles[-2:] == ["step 2: 256 tokens", "step 2: 256 tokens (training state)"]
    files = hub.files(REPO)
    assert "model.safetensors" in files and "optimizer.pt" not in files and "training_args.bin" not in files
    assert "last-checkpoint/optimizer.pt" in files and "last-checkpoint/training_args.bin" not in files
    assert b"Tokens seen: 256\n" in files["README.md"] and b'repo = "test-org/tiny-recurrent"' in files["README.md"]
    assert "Tokens seen: 128\n" in (out / "checkpoint-1" / "README.md").read_text()
    # The token reached the server but no file, card or log.
    assert any(m == "POST" for m, _, _ in hub.requests)
    assert not files_containing(out, TOKEN.encode())
    assert not any(TOKEN.encode() in content for content in files.values())
    captured = capfd.readouterr()
    assert TOKEN not in caplog.text and TOKEN not in captured.out and TOKEN not in captured.err
    assert re.search(r"Pushed .*checkpoint-2 to test-org/tiny-recurrent", caplog.text)
