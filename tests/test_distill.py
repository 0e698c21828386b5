"""trainer_ext.distill.losses: the chunked loss against naive full-logit references (CPU, fast)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trainer_ext.devices import has_triton
from trainer_ext.distill.losses import (
    DIVERGENCES,
    LossOutput,
    OnlineTeacher,
    TopKTeacher,
    chunked_lm_loss,
    chunk_logit_bytes,
    default_chunk_size,
    teacher_topk,
)

B, T, H, V = 2, 9, 8, 23
H_T = 12
CHUNK = 4  # smaller than, and not dividing, the 13 kept positions


def make_inputs(vocab=V, teacher_vocab=V, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(vocab, H, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[0, :3] = -100
    labels[1, 5] = -100
    labels[1, 8] = -100
    assert (labels != -100).sum() == 13
    t_hidden = torch.randn(B, T, H_T, generator=g).to(dtype)
    t_weight = (0.5 * torch.randn(teacher_vocab, H_T, generator=g)).to(dtype)
    return hidden, weight, labels, t_hidden, t_weight


def kl(p_lp, q_lp):
    """Per-row KL(p || q) from log-probs, via torch's own kl_div."""
    return F.kl_div(q_lp, p_lp, reduction="none", log_target=True).sum(-1)


def naive_divergence(t_lp, s_lp, divergence, beta):
    if divergence == "forward_kl":
        return kl(t_lp, s_lp)
    if divergence == "reverse_kl":
        return kl(s_lp, t_lp)
    m_lp = torch.log((beta * t_lp.exp() + (1 - beta) * s_lp.exp()).clamp_min(1e-300))
    return beta * kl(t_lp, m_lp) + (1 - beta) * kl(s_lp, m_lp)


def naive_loss(hidden, weight, labels, *, alpha, temp, divergence, beta=0.5,
               teacher_logits=None, vocab_limit=None, topk_ids=None):
    """Full (B, T, V) float64 logits; the teacher given as full logits (B, T, V_t).

    vocab_limit: ids >= it are set to a huge negative logit (probability exactly 0 in float64).
    topk_ids: restrict D to these ids plus one tail bucket, as the offline teacher does.
    """
    logits = hidden.double() @ weight.double().T
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    if teacher_logits is None:
        return ce, ce, torch.zeros(())
    keep = labels != -100
    s = logits[keep]  # (N, V)
    t = teacher_logits.double()[keep]  # (N, V_t)
    limit = vocab_limit or min(s.shape[1], t.shape[1])
    s = s.masked_fill(torch.arange(s.shape[1]) >= limit, -1e4)
    t = t.masked_fill(torch.arange(t.shape[1]) >= limit, -1e4)[:, : s.shape[1]]
    if topk_ids is None:
        t_lp = F.log_softmax(t / temp, -1)
        s_lp = F.log_softmax(s / temp, -1)
    else:
        ids = topk_ids[keep]
        t_top = F.log_softmax(t, -1).gather(1, ids)  # temperature-1 teacher log-probs
        mass = t_top.exp().sum(-1, keepdim=True)
        t_probs = torch.cat([mass * F.softmax(t_top / temp, -1), 1 - mass], -1)
        s_top = F.softmax(s / temp, -1).gather(1, ids)
        s_probs = torch.cat([s_top, 1 - s_top.sum(-1, keepdim=True)], -1)
        t_lp, s_lp = t_probs.log(), s_probs.log()
    kd = naive_divergence(t_lp, s_lp, divergence, beta).mean()
    return (1 - alpha) * ce + alpha * temp**2 * kd, ce, kd


def grads(loss, hidden, weight):
    return torch.autograd.grad(loss, (hidden, weight))


def assert_matches(out, ref, hidden, weight, rtol=1e-5, atol=1e-6):
    ref_loss, ref_ce, ref_kd = ref
    torch.testing.assert_close(out.loss, ref_loss.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.ce, ref_ce.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.kd, ref_kd.float(), rtol=rtol, atol=atol)
    for got, want in zip(grads(out.loss, hidden, weight), grads(ref_loss, hidden, weight)):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-6)


def test_plain_ce_equals_cross_entropy():
    hidden, weight, labels, _, _ = make_inputs()
    out = chunked_lm_loss(hidden, weight, labels, chunk_size=CHUNK)
    assert isinstance(out, LossOutput)
    ref = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, ref)
    assert out.kd.item() == 0.0 and not out.ce.requires_grad and not out.kd.requires_grad
    for got, want in zip(grads(out.loss, hidden, weight), grads(ref, hidden, weight)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("temp", [1.0, 2.0])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_online_matches_naive(divergence, temp, alpha):
    hidden, weight, labels, t_hidden, t_weight = make_inputs()
    teacher = OnlineTeacher(t_hidden, t_weight)
    out = chunked_lm_loss(hidden, weight, labels, teacher=teacher, alpha=alpha,
                          temperature=temp, divergence=divergence, jsd_beta=0.3, chunk_size=CHUNK)
    ref = naive_loss(hidden, weight, labels, alpha=alpha, temp=temp, divergence=divergence,
                     beta=0.3, teacher_logits=t_hidden @ t_weight.T)
    assert_matches(out, ref, hidden, weight)


@pytest.mark.parametrize("chunk_size", [1, 5, 13, 1024])
def test_chunk_size_does_not_change_result(chunk_size):
    hidden, weight, labels, t_hidden, t_weight = make_inputs()
    out = chunked_lm_loss(hidden, weight, labels, teacher=OnlineTeacher(t_hidden, t_weight),
                          temperature=2.0, chunk_size=chunk_size)
    ref = naive_loss(hidden, weight, labels, alpha=0.5, temp=2.0, divergence="forward_kl",
                     teacher_logits=t_hidden @ t_weight.T)
    assert_matches(out, ref, hidden, weight)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_padded_vocab_is_masked(divergence):
    # Teacher head padded past the tokenizer (huge logits there must not matter) and the student
    # head padded too; only ids < vocab_limit take part in D.
    hidden, weight, labels, t_hidden, t_weight = make_inputs(vocab=V + 2, teacher_vocab=V + 6)
    labels = labels.clamp(max=V - 1)  # -100 stays
    with torch.no_grad():
        t_weight[V:] = 50 * t_hidden.flatten(0, 1).mean(0)
    t_logits = t_hidden @ t_weight.T
    assert t_logits[..., V:].mean() > 10  # padding would dominate an unmasked softmax
    teacher = OnlineTeacher(t_hidden, t_weight, vocab_limit=V)
    out = chunked_lm_loss(hidden, weight, labels, teacher=teacher, temperature=2.0,
                          divergence=divergence, chunk_size=CHUNK)
    assert torch.isfinite(out.loss)
    ref = naive_loss(hidden, weight, labels, alpha=0.5, temp=2.0, divergence=divergence,
                     teacher_logits=t_logits, vocab_limit=V)
    assert_matches(out, ref, hidden, weight)


def test_teacher_topk_excludes_padding():
    logits = torch.randn(3, 5, V + 4)
    logits[..., V:] = 100.0
    ids, logprobs = teacher_topk(logits, k=6, vocab_limit=V)
    assert ids.shape == logprobs.shape == (3, 5, 6) and ids.dtype == torch.int64
    assert (ids < V).all()
    full = F.log_softmax(logits[..., :V], -1)
    torch.testing.assert_close(logprobs, full.gather(-1, ids))
    torch.testing.assert_close(logprobs, full.topk(6, -1).values)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("temp", [1.0, 2.0])
def test_topk_matches_naive_restricted(divergence, temp):
    hidden, weight, labels, t_hidden, t_weight = make_inputs(teacher_vocab=V + 3)
    t_logits = t_hidden @ t_weight.T
    ids, logprobs = teacher_topk(t_logits, k=5, vocab_limit=V)
    out = chunked_lm_loss(hidden, weight, labels, teacher=TopKTeacher(ids, logprobs),
                          temperature=temp, divergence=divergence, chunk_size=CHUNK)
    ref = naive_loss(hidden, weight, labels, alpha=0.5, temp=temp, divergence=divergence,
                     teacher_logits=t_logits, vocab_limit=V, topk_ids=ids)
    assert_matches(out, ref, hidden, weight)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("temp", [1.0, 2.0])
def test_topk_with_full_support_equals_online(divergence, temp):
    hidden, weight, labels, t_hidden, t_weight = make_inputs()
    ids, logprobs = teacher_topk(t_hidden @ t_weight.T, k=V)
    kwargs = dict(temperature=temp, divergence=divergence, chunk_size=CHUNK)
    offline = chunked_lm_loss(hidden, weight, labels, teacher=TopKTeacher(ids, logprobs), **kwargs)
    online = chunked_lm_loss(hidden, weight, labels, teacher=OnlineTeacher(t_hidden, t_weight), **kwargs)
    # Equal up to the tail floor (1e-6 of probability mass).
    torch.testing.assert_close(offline.loss, online.loss, rtol=0, atol=2e-5)
    for got, want in zip(grads(offline.loss, hidden, weight), grads(online.loss, hidden, weight)):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_topk_confident_teacher_stays_finite(divergence):
    # The cached probabilities sum to 1 in fp32, so the implied tail is 0 (or negative).
    hidden, weight, labels, _, _ = make_inputs()
    t_logits = torch.zeros(B, T, V)
    t_logits[..., 0] = 60.0
    ids, logprobs = teacher_topk(t_logits, k=2)
    out = chunked_lm_loss(hidden, weight, labels, teacher=TopKTeacher(ids.int(), logprobs),
                          divergence=divergence, chunk_size=CHUNK)
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(g).all() for g in grads(out.loss, hidden, weight))


def test_bf16_close_to_fp32():
    hidden, weight, labels, t_hidden, t_weight = make_inputs(dtype=torch.bfloat16)
    kwargs = dict(temperature=2.0, chunk_size=CHUNK)
    out = chunked_lm_loss(hidden, weight, labels, teacher=OnlineTeacher(t_hidden, t_weight), **kwargs)
    g_hidden, g_weight = grads(out.loss, hidden, weight)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert g_hidden.dtype == g_weight.dtype == torch.bfloat16

    h32, w32 = (x.detach().float().requires_grad_() for x in (hidden, weight))
    ref = chunked_lm_loss(h32, w32, labels, teacher=OnlineTeacher(t_hidden.float(), t_weight.float()),
                          **kwargs)
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-2, atol=1e-3)
    for got, want in zip((g_hidden, g_weight), grads(ref.loss, h32, w32)):
        assert torch.isfinite(got).all()
        assert F.cosine_similarity(got.float().flatten(), want.flatten(), dim=0) > 0.99


class _Produced(TorchDispatchMode):
    """Records the (dtype, shape) of every tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.tensors = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.tensors.add((t.dtype, tuple(t.shape)))
        return out


@pytest.mark.parametrize("teacher", [False, True])
def test_a_bf16_heads_gradient_is_summed_over_the_chunks_in_bf16(teacher):
    """A bf16 head's gradient is summed in bf16 over the chunks: no fp32 V x H tensor is made (it would be held beside
    the activations until backward), and the sum is each chunk's product (fp32 inside the product) added with one
    bf16 rounding a chunk, within those roundings of the chunks' products summed in fp32."""
    hidden, weight, labels, _, _ = make_inputs(dtype=torch.bfloat16)
    topk = TopKTeacher(*teacher_topk(torch.randn(B, T, V, generator=torch.Generator().manual_seed(3)), 5))
    with _Produced() as produced:
        out = chunked_lm_loss(hidden, weight, labels, teacher=topk if teacher else None, chunk_size=CHUNK)
    (1.5 * out.loss).backward()
    assert weight.grad.dtype == torch.bfloat16 and (torch.float32, (V, H)) not in produced.tensors
    if teacher:
        return
    # The same sum in fp32, from the chunks' gradients wrt their logits (the loss's own, in closed form).
    flat_hidden, flat_labels = hidden.detach().flatten(0, 1), labels.flatten()
    logits = (flat_hidden @ weight.detach().T).float().requires_grad_()
    ce = F.cross_entropy(logits, flat_labels, ignore_index=-100, reduction="sum") / (flat_labels != -100).sum()
    (grad_logits,) = torch.autograd.grad(1.5 * ce, logits)
    chunks = range(0, B * T, CHUNK)
    summed = sum(grad_logits[c:c + CHUNK].bfloat16().float().T @ flat_hidden[c:c + CHUNK].float() for c in chunks)
    assert (weight.grad.float() - summed).norm() / summed.norm() < len(chunks) * 2**-8


def test_backward_scales_by_grad_output():
    hidden, weight, labels, t_hidden, t_weight = make_inputs()
    teacher = OnlineTeacher(t_hidden, t_weight)
    once = grads(chunked_lm_loss(hidden, weight, labels, teacher=teacher).loss, hidden, weight)
    scaled = grads(2.5 * chunked_lm_loss(hidden, weight, labels, teacher=teacher).loss, hidden, weight)
    for a, b in zip(scaled, once):
        torch.testing.assert_close(a, 2.5 * b)


def test_second_backward_raises():
    hidden, weight, labels, _, _ = make_inputs()
    loss = chunked_lm_loss(hidden, weight, labels).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="single backward"):
        loss.backward()


def test_no_grad_and_frozen_head():
    hidden, weight, labels, _, _ = make_inputs()
    with_grad = chunked_lm_loss(hidden, weight, labels)
    with torch.no_grad():
        no_grad = chunked_lm_loss(hidden, weight, labels)
    assert no_grad.loss.grad_fn is None
    torch.testing.assert_close(no_grad.loss, with_grad.loss.detach())
    frozen = chunked_lm_loss(hidden, weight.detach(), labels)
    (g_hidden,) = torch.autograd.grad(frozen.loss, hidden)
    torch.testing.assert_close(g_hidden, grads(with_grad.loss, hidden, weight)[0])


def test_all_positions_ignored_gives_zero():
    hidden, weight, _, t_hidden, t_weight = make_inputs()
    labels = torch.full((B, T), -100)
    out = chunked_lm_loss(hidden, weight, labels, teacher=OnlineTeacher(t_hidden, t_weight))
    assert out.loss.item() == 0.0
    assert all((g == 0).all() for g in grads(out.loss, hidden, weight))


@pytest.mark.parametrize("teacher_kind", ["online", "topk"])
def test_no_positions_by_vocab_tensor(teacher_kind):
    # 4 x 32 = 128 positions, V = 64: a (positions, V) tensor has 8192 elements; every other
    # tensor here (chunk x V, V x H, hidden) has at most 3072.
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 32, 16, generator=g, requires_grad=True)
    weight = torch.randn(64, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 64, (4, 32), generator=g)
    t_hidden, t_weight = torch.randn(4, 32, 24, generator=g), torch.randn(64, 24, generator=g)
    if teacher_kind == "online":
        teacher = OnlineTeacher(t_hidden, t_weight)
    else:
        teacher = TopKTeacher(*teacher_topk((t_hidden @ t_weight.T).detach(), k=8))
    with _Produced() as mode:
        out = chunked_lm_loss(hidden, weight, labels, teacher=teacher, divergence="jsd", chunk_size=16)
        out.loss.backward()
    assert 0 < max(math.prod(shape) for _, shape in mode.tensors) < 128 * 64 / 2


class _OpNames(TorchDispatchMode):
    """Records the names of the ops run."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


# Ops whose result the host reads: on a GPU each waits for every kernel queued before it.
_HOST_READS = {"aten.nonzero.default", "aten._local_scalar_dense.default", "aten.is_nonzero.default",
               "aten.item.default"}


@pytest.mark.parametrize("teacher_kind", [None, "online", "topk"])
def test_loss_and_backward_never_wait_for_the_device(teacher_kind):
    hidden, weight, labels, t_hidden, t_weight = make_inputs()
    teacher = {None: None, "online": OnlineTeacher(t_hidden, t_weight),
               "topk": TopKTeacher(*teacher_topk(t_hidden @ t_weight.T, k=5))}[teacher_kind]
    with _OpNames() as mode:
        out = chunked_lm_loss(hidden, weight, labels, teacher=teacher, chunk_size=CHUNK)
        out.loss.backward()
    assert "aten.mm.default" in mode.names  # the mode saw the loss's ops
    assert not mode.names & _HOST_READS


def test_ignored_positions_get_zero_gradient():
    hidden, weight, labels, t_hidden, t_weight = make_inputs()
    out = chunked_lm_loss(hidden, weight, labels, teacher=OnlineTeacher(t_hidden, t_weight), chunk_size=CHUNK)
    (g_hidden,) = torch.autograd.grad(out.loss, hidden)
    ignored = labels == -100
    assert (g_hidden[ignored] == 0).all() and (g_hidden[~ignored] != 0).any(dim=-1).all()


def test_default_chunk_size_is_a_fixed_number_of_logits():
    assert default_chunk_size(65536) == 1024 == default_chunk_size(59296) and default_chunk_size(32768) == 2048
    assert default_chunk_size(99520) == 640 and default_chunk_size(10**9) == 128  # whole multiples of 128
    # The fused kernel's bf16 chunk: twice the positions in the same bytes; its fp32 chunk and the torch path: fp32.
    assert default_chunk_size(65536, 2) == 2048 and default_chunk_size(99520, 2) == 1280
    cuda = torch.device("cuda")
    # Plain CE and a cached teacher run the kernels; an online teacher takes the torch path.
    assert chunk_logit_bytes(torch.bfloat16, cuda, online_teacher=False) == (2 if has_triton() else 4)
    assert chunk_logit_bytes(torch.float32, cuda, False) == chunk_logit_bytes(torch.float16, cuda, False) == 4
    assert chunk_logit_bytes(torch.bfloat16, cuda, online_teacher=True) == 4 == chunk_logit_bytes(
        torch.bfloat16, torch.device("cpu"), False)
    hidden, weight, labels, _, _ = make_inputs()
    default = chunked_lm_loss(hidden, weight, labels)
    torch.testing.assert_close(default.loss, chunked_lm_loss(hidden, weight, labels, chunk_size=CHUNK).loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the half-precision head-gradient GEMM")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_head_on_cuda_matches_fp32(dtype):
    # On CUDA a bf16 head's gradient is summed over the chunks in bf16, each chunk's bf16 product accumulated in fp32
    # (fp16 takes the fp32 path): compare with the fp32 loss on the same rounded inputs (a CE gradient rounded to the
    # half dtype costs about 2**-8 relative, the bf16 sum of three chunks at most 3 x 2**-9 more).
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 300, 64, generator=g).to("cuda", dtype).requires_grad_()
    weight = (0.3 * torch.randn(500, 64, generator=g)).to("cuda", dtype).requires_grad_()
    labels = torch.randint(0, 500, (2, 300), generator=g).cuda()
    labels[0, :7] = -100
    out = chunked_lm_loss(hidden, weight, labels, chunk_size=128)
    got = torch.autograd.grad(out.loss, (hidden, weight))
    hidden32, weight32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    ref = chunked_lm_loss(hidden32, weight32, labels, chunk_size=128)
    want = torch.autograd.grad(ref.loss, (hidden32, weight32))
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-2, atol=1e-3)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        err = (a.float() - b).norm() / b.norm()
        assert err < 2**-6, err


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(alpha=1.5), "alpha"),
        (dict(alpha=-0.1), "alpha"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(divergence="kl"), "divergence"),
        (dict(jsd_beta=0.0), "jsd_beta"),
        (dict(jsd_beta=1.0), "jsd_beta"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=2.5), "chunk_size"),
        (dict(hidden=torch.zeros(B * T, H)), "hidden"),
        (dict(lm_head_weight=torch.zeros(V, H + 1)), "lm_head_weight"),
        (dict(labels=torch.zeros(B, T + 1, dtype=torch.long)), "labels"),
        (dict(labels=torch.zeros(B, T)), "labels"),
        (dict(teacher=OnlineTeacher(torch.zeros(B, T - 1, H_T), torch.zeros(V, H_T))), "teacher.hidden"),
        (dict(teacher=OnlineTeacher(torch.zeros(B, T, H_T), torch.zeros(V, H))), "teacher.lm_head_weight"),
        (dict(teacher=OnlineTeacher(torch.zeros(B, T, H_T), torch.zeros(V, H_T), V + 1)), "vocab_limit"),
        (dict(teacher=TopKTeacher(torch.zeros(B, T, 3), torch.zeros(B, T, 3))), "teacher.ids"),
        (dict(teacher=TopKTeacher(torch.zeros(B, T, 3, dtype=torch.long), torch.zeros(B, T, 4))),
         "teacher.logprobs"),
        (dict(teacher=TopKTeacher(torch.zeros(B, T, 5, dtype=torch.long), torch.zeros(B, T, 5), 4)), "k=5"),
        (dict(teacher=torch.zeros(B, T, V)), "teacher"),
    ],
)
def test_bad_arguments_raise(change, field):
    hidden, weight, labels, _, _ = make_inputs()
    args = dict(hidden=hidden, lm_head_weight=weight, labels=labels)
    args.update({k: v for k, v in change.items() if k in args})
    kwargs = {k: v for k, v in change.items() if k not in args}
    with pytest.raises(ValueError, match=field):
        chunked_lm_loss(args["hidden"], args["lm_head_weight"], args["labels"], **kwargs)


def test_teacher_topk_bad_k_raises():
    with pytest.raises(ValueError, match="k must be"):
        teacher_topk(torch.zeros(2, V + 3), k=V + 1, vocab_limit=V)
    with pytest.raises(ValueError, match="vocab_limit"):
        teacher_topk(torch.zeros(2, V), k=2, vocab_limit=V + 1)
