"""The fused kernels of the chunked loss (cross-entropy, trainer_ext/distill/ce_triton.py; distillation from a cached
top-k teacher, kd_triton.py) against its torch path.

On a CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess so that no other test sees
it); on a GPU it is also what `chunked_lm_loss` runs, checked against `F.cross_entropy` through autograd.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from trainer_ext.distill.losses import (
    IGNORE_INDEX, TopKTeacher, _chunk_loss_sums, _ce_and_grad, _fused_topk_loss, _Options, chunked_lm_loss,
    teacher_topk)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (the test extra on Linux x86-64)")


def check_kernel(device: str) -> None:
    """Loss and gradient of the kernel equal the torch path's on the same logits: fp32 and bf16 logits, one block
    and several with a partial last one (vocabularies of 1,000 and 20,000), ignored positions, no gradient."""
    from trainer_ext.distill.ce_triton import ce_and_grad

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (1000, 20000):
            logits = (3 * torch.randn(9, vocab, generator=g)).to(device, dtype)
            targets = torch.randint(0, vocab, (9,), generator=g).to(device)
            targets[[1, 5]] = IGNORE_INDEX
            scale = torch.tensor(0.37, device=device)
            want_ce, want_grad = _ce_and_grad(logits.float().clone(), targets, scale)  # overwrites its input
            got_ce, got_grad = ce_and_grad(logits.clone(), targets, scale, IGNORE_INDEX)
            assert got_grad.dtype == dtype
            assert torch.allclose(got_ce, want_ce, rtol=1e-5), (dtype, vocab, got_ce, want_ce)
            # The torch path casts its fp32 gradient to the head's dtype: the kernel's store rounds the same value,
            # where a different order of the sums may move it by one step of that dtype.
            tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
            error = (got_grad.float() - want_grad.to(dtype).float()).abs().max()
            assert error <= tolerance * want_grad.abs().max(), (dtype, vocab, error)
            assert torch.all(got_grad[[1, 5]] == 0)
            untouched = logits.clone()
            ce_only, no_grad = ce_and_grad(untouched, targets, None, IGNORE_INDEX)
            assert no_grad is None and torch.equal(untouched, logits)
            assert torch.allclose(ce_only, want_ce, rtol=1e-5)
    print("kernel ok")


def check_kd_kernels(device: str) -> None:
    """CE, the divergence and the gradient wrt the logits of the fused top-k path equal the torch path's (autograd
    over fp32 logits) on the same logits: every divergence, temperatures 1 and 2, a head wider than the real
    vocabulary (padding rows outside the divergence), a vocabulary of several blocks, ignored positions (a target in
    the padding rows too), fp32 and bf16 logits, and the no-gradient call."""
    g = torch.Generator().manual_seed(0)
    rows, topk = 11, 24
    for dtype in (torch.float32, torch.bfloat16):
        for vocab, limit in ((1000, 1000), (20000, 19000)):
            logits = (3 * torch.randn(rows, vocab, generator=g)).to(device, dtype)
            targets = torch.randint(0, vocab, (rows,), generator=g).to(device)
            targets[[2, 7]] = IGNORE_INDEX
            targets[4] = vocab - 1  # in the padding rows where limit < vocab
            ids, logprobs = teacher_topk(2 * torch.randn(rows, vocab, generator=g), topk, limit)
            teacher = TopKTeacher(ids=ids.to(device), logprobs=logprobs.to(device, torch.float16))
            for divergence in ("forward_kl", "reverse_kl", "jsd"):
                for temperature in (1.0, 2.0):
                    options = _Options(alpha=0.5, temperature=temperature, divergence=divergence, jsd_beta=0.3,
                                       chunk_size=rows, vocab_limit=limit, grad_hidden=True, grad_weight=True)
                    weights = (torch.tensor(0.21, device=device), torch.tensor(0.43, device=device))
                    reference = logits.float().clone().requires_grad_()
                    want_ce, want_kd = _chunk_loss_sums(reference, targets, teacher, slice(0, rows), options)
                    (want_grad,) = torch.autograd.grad(weights[0] * want_ce + weights[1] * want_kd, reference)
                    got_ce, got_kd, got_grad = _fused_topk_loss(logits.clone(), targets, teacher, slice(0, rows),
                                                                options, weights)
                    case = (dtype, vocab, divergence, temperature)
                    assert got_grad.dtype == dtype, case
                    torch.testing.assert_close(got_ce, want_ce.detach(), rtol=1e-5, atol=1e-4, msg=str(case))
                    torch.testing.assert_close(got_kd, want_kd.detach(), rtol=1e-4, atol=1e-5, msg=str(case))
                    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
                    error = (got_grad.float() - want_grad.to(dtype).float()).abs().max()
                    assert error <= tolerance * want_grad.abs().max(), (case, error)
                    assert torch.all(got_grad[[2, 7]] == 0), case
                    untouched = logits.clone()
                    ce, kd, none = _fused_topk_loss(untouched, targets, teacher, slice(0, rows), options, None)
                    assert none is None and torch.equal(untouched, logits)
                    torch.testing.assert_close(kd, want_kd.detach(), rtol=1e-4, atol=1e-5, msg=str(case))
    print("kd kernels ok")


def run_under_interpreter(check: str, expected: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_ce_kernel; " \
           f"test_ce_kernel.{check}('cpu')"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and expected in result.stdout, result.stderr[-3000:]


@needs_triton
def test_fused_ce_equals_the_torch_path_under_the_interpreter():
    run_under_interpreter("check_kernel", "kernel ok")


@needs_triton
def test_fused_topk_distillation_equals_the_torch_path_under_the_interpreter():
    run_under_interpreter("check_kd_kernels", "kd kernels ok")


def test_the_kernel_refuses_logits_strided_along_the_vocabulary():
    pytest.importorskip("triton")
    from trainer_ext.distill.ce_triton import ce_and_grad

    with pytest.raises(ValueError, match="contiguous along the vocabulary"):
        ce_and_grad(torch.zeros(8, 6).T, torch.zeros(6, dtype=torch.long), None, IGNORE_INDEX)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_ce_matches_the_torch_path_on_gpu():
    check_kernel("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_topk_distillation_matches_the_torch_path_on_gpu():
    check_kd_kernels("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_loss_on_gpu_matches_cross_entropy():
    """The chunked loss over a bf16 head (the kernel's path, three chunks) against F.cross_entropy of the full
    logits in fp32 through autograd: loss and both gradients."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 192, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    weight = (0.3 * torch.randn(3000, 64, generator=g)).to("cuda", torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 3000, (2, 192), generator=g).cuda()
    labels[:, :7] = IGNORE_INDEX
    loss = chunked_lm_loss(hidden, weight, labels, chunk_size=128).loss
    loss.backward()
    hidden_ref = hidden.detach().float().requires_grad_()
    weight_ref = weight.detach().float().requires_grad_()
    logits = (hidden_ref @ weight_ref.T).to(torch.bfloat16).float()  # the bf16 head's logits
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    reference.backward()
    assert torch.allclose(loss.float(), reference, rtol=1e-4), (loss, reference)
    for got, want in ((hidden.grad, hidden_ref.grad), (weight.grad, weight_ref.grad)):
        assert ((got.float() - want).norm() / want.norm()) < 2**-6
