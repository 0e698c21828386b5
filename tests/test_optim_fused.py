"""The fused Triton update of LowMemoryAdafactor against its torch path (trainer_ext/optim/triton_kernels.py).

On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess so that no other test
sees it), where they must give the torch path's bf16 weights and momentum but for a few last-bit flips: same math,
same random bits. With subspace momentum (bf16 GEMM operands) and on a GPU (compiled glue, other sum orders) each
tensor must be within 2**-8 of it.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from trainer_ext.optim.optimizer import LowMemoryAdafactor

# (shape, dtype, momentum, momentum_rank_fraction, max_chunk_numel, more optimizer settings): plain, full and
# subspace momentum, fp32 weights, row chunks (the embedding matrices' case) with and without the subspace (and its
# residual scaled down), a rank below one tensor-core block, Adafactor's beta2 schedule; every run has a step with a
# NaN.
CASES = [
    ((96, 200), torch.bfloat16, None, None, 2**24, {}),
    ((96, 200), torch.bfloat16, 0.9, None, 2**24, {}),
    ((96, 200), torch.bfloat16, 0.9, 0.25, 2**24, {}),
    ((96, 200), torch.float32, 0.9, None, 2**24, {}),
    ((96, 200), torch.bfloat16, 0.9, 0.25, 200 * 30, {}),
    ((96, 200), torch.bfloat16, 0.9, 0.25, 200 * 30, {"subspace_residual": 0.25}),
    ((70, 33), torch.bfloat16, None, None, 33 * 8, {}),
    ((96, 200), torch.bfloat16, 0.9, 1 / 16, 2**24, {"beta2_decay": 0.8, "beta2": 1.0, "clip_threshold": 0.5}),
]
# Vectors (norm scales, biases: one program each): plain and with momentum, fp32, several blocks with a partial last
# one, Adafactor's beta2 schedule, a 0-d tensor.
VECTOR_CASES = [
    ((768,), torch.bfloat16, None, None, 2**24, {}),
    ((768,), torch.bfloat16, 0.9, None, 2**24, {}),
    ((300,), torch.float32, 0.9, None, 2**24, {}),
    ((2500,), torch.bfloat16, 0.9, None, 2**24, {"beta2_decay": 0.8, "beta2": 1.0, "clip_threshold": 0.5}),
    ((), torch.float32, 0.9, None, 2**24, {}),
]


def _run(fused: bool, device: str, shape, dtype, momentum, fraction, max_chunk_numel, settings, steps=5, nan_step=2):
    torch.manual_seed(1)
    weight = nn.Parameter(torch.randn(shape).to(device=device, dtype=dtype))
    initial = weight.detach().float().cpu().clone()
    optimizer = LowMemoryAdafactor([weight], lr=0.01, weight_decay=0.1, momentum=momentum,
                                   momentum_rank_fraction=fraction, projection_interval=2, fused=fused,
                                   compile=fused or device == "cuda",  # the reference: compiled on a GPU
                                   max_chunk_numel=max_chunk_numel, **settings)
    generator = torch.Generator().manual_seed(2)
    norms = []
    for step in range(steps):
        grad = torch.randn(shape, generator=generator)
        if step == nan_step:
            grad.view(-1)[0] = float("nan")
        weight.grad = grad.to(device=device, dtype=dtype)
        optimizer.step()
        norms.append(optimizer.last_grad_norm)
    state = {k: v.float().cpu() for k, v in optimizer.state[weight].items() if isinstance(v, torch.Tensor)}
    return weight.detach().float().cpu() - initial, state, norms, optimizer.skipped_updates


def check_all(device: str, cases=CASES) -> None:
    """Raise AssertionError unless the fused path matches the torch path on every case."""
    for case in cases:
        reference, reference_state, reference_norms, reference_skips = _run(False, device, *case)
        fused, fused_state, fused_norms, fused_skips = _run(True, device, *case)
        assert fused_skips == reference_skips == 1, case
        assert fused_state["step"].item() == reference_state["step"].item() == 4, case
        torch.testing.assert_close(torch.tensor(fused_norms[:2] + fused_norms[3:]),
                                   torch.tensor(reference_norms[:2] + reference_norms[3:]), rtol=1e-5, atol=0)
        for name in ("row", "col", "second_moment"):  # the factors of a matrix, a vector's second moment
            if name in reference_state:
                torch.testing.assert_close(fused_state[name], reference_state[name], rtol=1e-5, atol=0)
        # The weights' change over the run (the weights themselves would hide an error in the update).
        pairs = [(fused, reference)] + ([(fused_state["momentum"], reference_state["momentum"])]
                                        if "momentum" in reference_state else [])
        for (got, want), name in zip(pairs, ("weight change", "momentum")):
            if case[1] == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
                continue
            # bf16: the same random bits round the same fp32 values the same way, so elements differ only where an
            # fp32 value differs in its last bit at a rounding boundary (one step: 2**-7 of the weight). On a CPU
            # that is a handful of elements.
            if device == "cpu" and case[3] is None:
                assert (got != want).float().mean() <= 1e-3, (case, name, (got != want).sum())
                continue
            # Subspace momentum multiplies with bf16 operands (8 bits of the basis and of D), and on a GPU the sums
            # run in other orders: some elements round the other way, one bf16 step each, so this bounds the
            # relative error of the whole tensor (an update without its subspace term is 0.27-0.37 off).
            error = (got - want).norm() / want.norm()
            assert error <= (2**-4 if name == "weight change" else 2**-7), (case, name, error.item())


def _check_under_the_interpreter(setup: str = "pass", cases: str = "test_optim_fused.CASES") -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_optim_fused; {setup}; " \
           f"test_optim_fused.check_all('cpu', {cases})"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the test extra on Linux x86-64)")
def test_fused_update_equals_the_torch_path_under_the_interpreter():
    _check_under_the_interpreter()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the test extra on Linux x86-64)")
def test_fused_update_in_small_blocks_equals_the_torch_path():
    """The row factor's mean over several row programs of 32 rows (70 rows: a partial last one), the subspace
    back-projection in blocks of 7 rows, which do not divide the chunks of 30 rows, and the statistics pass's strips
    of 4 tiles of 8 rows (96 rows: three strips; 70 rows: a partial last tile): what the defaults reach only on
    matrices of more than 1,024 rows, 2**24 elements or 1,024 tiles."""
    _check_under_the_interpreter(
        "from trainer_ext.optim import triton_kernels as kernels; kernels._FACTOR_ROWS = 32; "
        "kernels._BACK_NUMEL = 200 * 7; kernels._STATS_ROWS, kernels._STATS_STRIP, kernels._STATS_PROGRAMS = 8, 4, 1",
        "[test_optim_fused.CASES[i] for i in (1, 2, 4, 5, 6)]")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the test extra on Linux x86-64)")
def test_fused_vector_update_equals_the_torch_path_under_the_interpreter():
    _check_under_the_interpreter(cases="test_optim_fused.VECTOR_CASES")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_update_matches_the_torch_path_on_gpu():
    check_all("cuda", CASES + VECTOR_CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_path_is_the_default_for_cuda_matrices():
    weight = nn.Parameter(torch.randn(64, 48, device="cuda", dtype=torch.bfloat16))
    weight.grad = torch.randn_like(weight)
    optimizer = LowMemoryAdafactor([weight], lr=0.01)
    from trainer_ext.optim import triton_kernels

    calls = []
    original = triton_kernels.fused_factored_update
    triton_kernels.fused_factored_update = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        optimizer.step()
    finally:
        triton_kernels.fused_factored_update = original
    assert calls == [1]


def test_the_optimizer_fused_flag_reaches_the_optimizer(tiny_data_dir, tmp_path):
    from test_trainer import make_trainer

    for flag in (True, False):
        trainer = make_trainer(tiny_data_dir, tmp_path / str(flag), optimizer_fused=flag)
        assert trainer.create_optimizer().fused is flag


def test_the_kernel_benchmark_weighs_every_matrix_of_the_preset():
    """benchmarks/optimizer_kernels.py times one matrix of each shape and counts it as often as the model has it:
    recurrent-3.3b's 16 layers (attention with 8 key-value heads, SwiGLU), the recurrence's adapter, embedding, head."""
    from benchmarks.optimizer_kernels import matrix_shapes
    from hf_recurrent import presets

    config = presets.get("recurrent-3.3b")
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * H // config.num_attention_heads
    layers = config.n_prelude_layers + config.n_core_layers + config.n_coda_layers
    counts, total = matrix_shapes("recurrent-3.3b")
    assert counts == {(H, H): 2 * layers, (kv, H): 2 * layers, (I, H): 2 * layers, (H, I): layers, (V, H): 2,
                      (H, 2 * H): 1}
    vectors = total - sum(r * c * n for (r, c), n in counts.items())
    assert vectors % H == 0 and 0 < vectors < 8 * layers * H  # norm scales only: a few of the hidden size a layer
