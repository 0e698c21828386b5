"""Tests of the low-memory optimizer (CPU; the GPU test skips without CUDA)."""

import gc
import io
import math
import weakref

import pytest
import torch
from torch import nn

from trainer_ext.optim.optimizer import LowMemoryAdafactor, check_gradient_accumulation, create_optimizer
from trainer_ext.optim.kernels import round_to_bf16_stochastic


@pytest.fixture
def one_thread():
    """Tiny bf16 matmuls on CPU run far slower multi-threaded when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)).to(dtype)


def _batches(num, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=generator).to(dtype), torch.randn(16, 4, generator=generator).to(dtype))
            for _ in range(num)]


def _loss(model, batch):
    inputs, targets = batch
    return (model(inputs).float() - targets.float()).square().mean()


def _train(model, optimizer, scheduler, batches):
    for batch in batches:
        _loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


# ----------------------------------------------------------------------------- state


def test_factored_state_sizes_and_state_bytes():
    matrix = nn.Parameter(torch.randn(1024, 512))
    stacked = nn.Parameter(torch.randn(4, 8, 16))
    vector = nn.Parameter(torch.randn(512))
    optimizer = LowMemoryAdafactor([matrix, stacked, vector], lr=1e-3)
    for p in (matrix, stacked, vector):
        p.grad = torch.randn_like(p)
    optimizer.step()

    state = optimizer.state
    assert state[matrix]["row"].shape == (1024,) and state[matrix]["col"].shape == (512,)
    assert state[stacked]["row"].shape == (4, 8) and state[stacked]["col"].shape == (4, 16)
    assert state[vector]["second_moment"].shape == (512,)
    assert all(v.dtype == torch.float32 for s in state.values() for v in s.values())
    assert "momentum" not in state[matrix]
    step_bytes = 3 * 4
    assert optimizer.state_bytes() == 4 * (1024 + 512 + 4 * 8 + 4 * 16 + 512) + step_bytes


def test_bf16_momentum_state_is_bf16_and_counted():
    weight = nn.Parameter(torch.randn(64, 32, dtype=torch.bfloat16))
    optimizer = LowMemoryAdafactor([weight], lr=1e-3, momentum=0.9)
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    assert optimizer.state[weight]["momentum"].dtype == torch.bfloat16
    assert weight.dtype == torch.bfloat16
    assert optimizer.state_bytes() == 4 * (64 + 32) + 2 * 64 * 32 + 4


# ----------------------------------------------------------------------------- math


def _reference_run(params, grads_per_step, clips, lr, weight_decay, beta1, beta2, eps, projectors=None, residual=1.0):
    """The documented formulas, written independently, in float64. ``projectors[t][i]``: the subspace basis of
    parameter i at step t (None: full momentum); ``residual``: the factor of the update outside it."""
    params = [p.detach().double().clone() for p in params]
    second = [None] * len(params)
    momentum = [torch.zeros_like(p) for p in params]
    previous = [None] * len(params)
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (p, g, clip) in enumerate(zip(params, grads, clips)):
            g = g.double()
            g2 = g * g + eps
            if p.ndim >= 2:
                row, col = second[i] or (torch.zeros(g.shape[:-1]).double(), torch.zeros(g.shape[:-2] + g.shape[-1:]).double())
                row = beta2 * row + (1 - beta2) * g2.mean(-1)
                col = beta2 * col + (1 - beta2) * g2.mean(-2)
                second[i] = (row, col)
                v_hat = row.unsqueeze(-1) * col.unsqueeze(-2) / row.mean(-1, keepdim=True).unsqueeze(-1)
            else:
                v_hat = (second[i] if second[i] is not None else 0.0) * beta2 + (1 - beta2) * g2
                second[i] = v_hat
            update = g / (v_hat / (1 - beta2**t)).sqrt()
            update = update / max(1.0, update.square().mean().sqrt().item() / clip)
            basis = projectors[t - 1][i] if projectors else None
            if beta1 is not None and basis is not None:
                basis = basis.double()
                if previous[i] is None:
                    momentum[i] = torch.zeros(p.shape[0], basis.shape[1]).double()
                else:  # carried into the new basis
                    momentum[i] = momentum[i] @ previous[i].T @ basis
                previous[i] = basis
                projected = update @ basis
                momentum[i] = beta1 * momentum[i] + (1 - beta1) * projected
                outside = update - projected @ basis.T
                update = residual * outside + (momentum[i] / (1 - beta1**t)) @ basis.T
            elif beta1 is not None:
                momentum[i] = beta1 * momentum[i] + (1 - beta1) * update
                update = momentum[i] / (1 - beta1**t)
            p.mul_(1 - lr * weight_decay).sub_(lr * update)
    return params


@pytest.mark.parametrize("max_chunk_numel", [2**24, 7, 40])
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_fp32_steps_match_reference(max_chunk_numel, beta1):
    torch.manual_seed(0)
    shapes = [(12, 10), (10,), (3, 5, 4), ()]
    # Adam-normalised updates have an RMS near 1: the first group is clipped, the second is not
    # (there the bias correction shows).
    clips = [0.5, 0.5, 100.0, 100.0]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    hyper = dict(lr=0.01, weight_decay=0.1, beta2=0.99, eps=1e-30)
    expected = _reference_run(params, grads, clips, beta1=beta1, **hyper)
    groups = [{"params": params[:2], "clip_threshold": 0.5}, {"params": params[2:], "clip_threshold": 100.0}]
    optimizer = LowMemoryAdafactor(groups, momentum=beta1, max_chunk_numel=max_chunk_numel, compile=False, **hyper)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_chunk_numel,residual", [(2**24, 1.0), (30, 1.0), (2**24, 0.25), (30, 0.0)])
def test_subspace_momentum_matches_reference(max_chunk_numel, residual):
    # Bases are refreshed at steps 0, 3 and 6; between refreshes they stay; momentum moves into each new basis.
    torch.manual_seed(0)
    shapes = [(12, 10), (10,), (9, 16)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    initial = [p.detach().clone() for p in params]
    grads = [[torch.randn(s) for s in shapes] for _ in range(7)]
    hyper = dict(lr=0.01, weight_decay=0.1, beta2=0.99, eps=1e-30)
    optimizer = LowMemoryAdafactor(params, momentum=0.9, momentum_rank_fraction=0.25, projection_interval=3,
                                   max_chunk_numel=max_chunk_numel, compile=False, subspace_residual=residual,
                                   **hyper)
    projectors = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
        projectors.append([optimizer.state[p].get("projector", None) for p in params])
        projectors[-1] = [None if b is None else b.clone() for b in projectors[-1]]
    assert [tuple(b.shape) for b in projectors[0] if b is not None] == [(10, 3), (16, 3)]  # r = ceil(min(R, C) / 4)
    assert optimizer.state[params[0]]["momentum"].shape == (12, 3) and projectors[0][1] is None  # 1-D: full momentum
    for t in (1, 2, 4, 5):
        assert torch.equal(projectors[t][0], projectors[t - 1][0]) == (t % 3 != 0)
    assert not torch.equal(projectors[3][0], projectors[2][0])
    for basis in projectors[6]:
        if basis is not None:
            torch.testing.assert_close(basis.T @ basis, torch.eye(3), atol=1e-5, rtol=0)
    expected = _reference_run(initial, grads, [1.0] * 3, beta1=0.9, projectors=projectors, residual=residual,
                              **hyper)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-5)


def test_subspace_basis_spans_a_low_rank_gradient_and_survives_non_finite_ones():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.zeros(40, 24))
    optimizer = LowMemoryAdafactor([weight], lr=0.01, momentum=0.9, momentum_rank_fraction=0.125,
                                   projection_interval=1, compile=False)
    low_rank = torch.randn(40, 3) @ torch.randn(3, 24)  # rank 3 = ceil(24 / 8)
    weight.grad = low_rank.clone()
    optimizer.step()
    basis = optimizer.state[weight]["projector"]
    torch.testing.assert_close(low_rank @ basis @ basis.T, low_rank, atol=1e-4, rtol=1e-4)  # the row space, exactly
    before = (weight.detach().clone(), basis.clone(), optimizer.state[weight]["momentum"].clone())
    weight.grad = torch.full_like(low_rank, float("nan"))
    optimizer.step()
    state = optimizer.state[weight]
    assert optimizer.last_step_skips == 1
    for kept, now in zip(before, (weight.detach(), state["projector"], state["momentum"])):
        assert torch.equal(kept, now)


def test_adafactor_beta2_schedule_is_unbiased_without_correction():
    # With beta2_t = 1 - t**-0.8, beta2_1 = 0: after one step the second moment is exactly g**2 + eps,
    # so a constant gradient gives |update| = 1 everywhere.
    weight = nn.Parameter(torch.zeros(4, 6))
    optimizer = LowMemoryAdafactor([weight], lr=0.1, beta2=1.0, beta2_decay=0.8)
    for _ in range(3):
        weight.grad = torch.full((4, 6), 3.0)
        optimizer.step()
    torch.testing.assert_close(weight.detach(), torch.full((4, 6), -0.3), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_is_unbiased():
    low, high = 1.0, 1.0 + 2**-7  # neighbouring bf16 values
    value = low + 0.3 * (high - low)
    x = torch.full((200_000,), value, dtype=torch.float32)
    bits = torch.randint(-(2**31), 2**31 - 1, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    rounded = round_to_bf16_stochastic(x, bits)
    assert rounded.dtype == torch.bfloat16
    assert set(rounded.float().unique().tolist()) == {low, high}
    assert abs(rounded.double().mean().item() - value) < 5e-5  # nearest rounding would be off by 2.3e-3
    negative = round_to_bf16_stochastic(-x, bits)
    assert abs(negative.double().mean().item() + value) < 5e-5
    exact = torch.tensor([0.5, -2.0, 0.0])
    assert torch.equal(round_to_bf16_stochastic(exact, bits[:3]).float(), exact)


def test_bf16_weights_move_by_updates_smaller_than_a_bf16_step():
    # Each step subtracts lr = 1e-3 from 1.0; bf16's spacing below 1.0 is 2**-8 = 3.9e-3, so nearest
    # rounding would keep every weight at exactly 1.0.
    weight = nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    optimizer = LowMemoryAdafactor([weight], lr=1e-3, compile=False, max_chunk_numel=16 * 64)
    for _ in range(100):
        weight.grad = torch.ones_like(weight)
        optimizer.step()
    assert weight.dtype == torch.bfloat16
    assert abs(weight.float().mean().item() - 0.9) < 0.005
    # Rounded independently per element, and per chunk (each chunk has its own random stream).
    assert weight.float().std().item() > 0
    assert not torch.equal(weight[:16], weight[16:32])


# ----------------------------------------------------------------------------- in backward


@pytest.mark.parametrize("subspace", [None, dict(momentum_rank_fraction=0.25, projection_interval=2)])
def test_in_backward_equals_classic_with_scheduler(subspace):
    classic_model, backward_model = _mlp(), _mlp()
    options = dict(lr=0.01, weight_decay=0.1, momentum=0.9, **(subspace or {}))
    classic = create_optimizer(classic_model, in_backward=False, **options)
    in_backward = create_optimizer(backward_model, in_backward=True, **options)
    assert [g["weight_decay"] for g in classic.param_groups] == [0.1, 0.0]  # biases are not decayed
    schedule = lambda step: 1.0 / (1 + step)  # noqa: E731
    classic_scheduler = torch.optim.lr_scheduler.LambdaLR(classic, schedule)
    backward_scheduler = torch.optim.lr_scheduler.LambdaLR(in_backward, schedule)

    for step, batch in enumerate(_batches(5)):
        _loss(classic_model, batch).backward()
        expected_norm = torch.cat([p.grad.flatten() for p in classic_model.parameters()]).norm().item()
        classic.step()
        classic.zero_grad()
        classic_scheduler.step()

        _loss(backward_model, batch).backward()
        assert all(p.grad is None for p in backward_model.parameters())
        in_backward.step()
        in_backward.zero_grad()
        backward_scheduler.step()

        assert in_backward.last_grad_norm == pytest.approx(expected_norm, rel=1e-5)
        assert classic.last_grad_norm == pytest.approx(expected_norm, rel=1e-5)
        assert in_backward.param_groups[0]["lr"] == pytest.approx(0.01 / (step + 2))

    for a, b in zip(classic_model.parameters(), backward_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The schedule mattered: a constant learning rate ends elsewhere.
    constant_model = _mlp()
    _train(constant_model, create_optimizer(constant_model, in_backward=True, **options), None, _batches(5))
    assert not torch.equal(constant_model[0].weight, backward_model[0].weight)


def test_gradient_accumulation_is_refused_in_backward():
    check_gradient_accumulation(1)
    check_gradient_accumulation(4, in_backward=False)
    with pytest.raises(ValueError, match="larger per-device batch size"):
        check_gradient_accumulation(2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        create_optimizer(_mlp(), lr=0.01, in_backward=True, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        check_gradient_accumulation(0, in_backward=False)
    # Two backward passes without a step would update the weights twice: refused at run time too.
    model = _mlp()
    optimizer = create_optimizer(model, lr=0.01, in_backward=True)
    batch = _batches(1)[0]
    _loss(model, batch).backward()
    with pytest.raises(RuntimeError, match="accumulated twice"):
        _loss(model, batch).backward()


def test_a_gate_asked_at_the_first_update_in_backward_skips_or_lets_the_whole_step_through():
    gated_model, reference_model = _mlp(), _mlp()
    gated = create_optimizer(gated_model, lr=0.01, momentum=0.9, in_backward=True)
    reference = create_optimizer(reference_model, lr=0.01, momentum=0.9, in_backward=True)
    asked = []

    def decide(answer):
        def gate():  # asked before any weight of the step changed, once a step
            asked.append(all(torch.equal(a, b) for a, b in zip(gated_model.parameters(), before)))
            return answer
        return gate

    for step, batch in enumerate(_batches(4)):
        before = [p.detach().clone() for p in gated_model.parameters()]
        state = {id(p): {k: v.clone() for k, v in gated.state[p].items() if torch.is_tensor(v)}
                 for p in gated_model.parameters() if p in gated.state}
        skip = step == 2
        gated.gate_backward(decide(not skip))
        _loss(gated_model, batch).backward()
        gated.step()
        assert all(p.grad is None for p in gated_model.parameters())  # a skipped step frees its gradients too
        if skip:  # no weight and no optimizer state changed
            assert all(torch.equal(a, b) for a, b in zip(gated_model.parameters(), before))
            assert all(torch.equal(v, state[id(p)][k]) for p in gated_model.parameters()
                       for k, v in gated.state[p].items() if torch.is_tensor(v))
            continue
        _loss(reference_model, batch).backward()
        reference.step()
        # a step let through is the ungated optimizer's (the reference skips what the gated one skipped)
        assert all(torch.equal(a, b) for a, b in zip(gated_model.parameters(), reference_model.parameters()))
    assert asked == [True] * 4
    gated.gate_backward(decide(False))
    gated.step()  # a gate that no update asked for ends with the step: the next backward updates
    before = [p.detach().clone() for p in gated_model.parameters()]
    _loss(gated_model, _batches(1)[0]).backward()
    assert not any(torch.equal(a, b) for a, b in zip(gated_model.parameters(), before)) and len(asked) == 4


def test_param_group_added_after_attach_is_updated_in_backward():
    model = _mlp()
    first, rest = model[0], nn.Sequential(*model[1:])
    optimizer = LowMemoryAdafactor(first.parameters(), lr=0.01)
    optimizer.attach_to_backward()
    optimizer.add_param_group({"params": rest.parameters(), "lr": 0.02})
    before = model[4].weight.detach().clone()
    _loss(model, _batches(1)[0]).backward()
    optimizer.step()
    assert model[4].weight.grad is None and not torch.equal(model[4].weight, before)


def test_a_dropped_in_backward_optimizer_frees_its_weights_and_leaves_no_hooks():
    # A finished training (the comparison trains both models in one process, the threshold test one model per rate)
    # drops its model and optimizer: their tensors must go with them, and a model kept without its optimizer must
    # train as a plain module again.
    model = _mlp()
    optimizer = create_optimizer(model, lr=0.01, in_backward=True)
    _loss(model, _batches(1)[0]).backward()
    optimizer.step()
    weight = weakref.ref(model[0].weight)
    state = weakref.ref(optimizer.state[model[0].weight]["row"])
    del optimizer
    gc.collect()
    _loss(model, _batches(1)[0]).backward()  # no hook of the dropped optimizer consumes the gradient
    assert model[0].weight.grad is not None and state() is None
    del model
    gc.collect()
    assert weight() is None


class _FakeStream:
    """Stands in for a CUDA stream on the CPU: logs what the in-backward hooks ask of it."""

    def __init__(self, name, log):
        self.name, self.log, self.device = name, log, torch.device("cpu")

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


def test_updates_beside_backward_wait_for_their_gradient_and_backward_ends_after_them(monkeypatch):
    # On one CUDA device the in-backward updates run on a stream of their own: each must wait for backward's work so
    # far (its gradient), run inside its stream, keep its gradient from reuse until read, and the end of backward
    # must make backward's stream wait for them all, once. Faked streams on the CPU; the updates are the same.
    import contextlib
    from trainer_ext.optim import in_backward as hooks_module

    log = []
    main = _FakeStream("main", log)
    inside = []

    @contextlib.contextmanager
    def run_on(stream):
        inside.append(stream.name)
        yield
        inside.pop()

    monkeypatch.setattr(hooks_module.torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(hooks_module.torch.cuda, "stream", run_on)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda tensor, stream: log.append(("record", stream.name, tuple(tensor.shape))), raising=False)
    update = LowMemoryAdafactor._update

    def logged_update(self, p, group, index, grad=None):
        log.append(("update", inside[-1] if inside else None, tuple(p.shape)))
        return update(self, p, group, index, grad)

    monkeypatch.setattr(LowMemoryAdafactor, "_update", logged_update)
    reference, model = _mlp(), _mlp()
    options = dict(lr=0.01, weight_decay=0.1, momentum=0.9)
    plain = create_optimizer(reference, in_backward=True, **options)
    beside = create_optimizer(model, in_backward=True, update_stream=True, **options)
    assert beside._hooks.stream is None  # the CPU: no stream of its own
    beside._hooks.stream = _FakeStream("updates", log)
    for batch in _batches(3):
        _loss(reference, batch).backward()
        plain.step()
        log.clear()
        _loss(model, batch).backward()
        beside.step()
        updates = [entry for entry in log if entry[0] == "update"]
        assert len(updates) == 6 and all(where == "updates" for _, where, _ in updates)
        for i, entry in enumerate(log[:-1]):
            if entry[0] == "update":  # waited before, its gradient recorded after
                assert ("wait", "updates", "main") in log[:i]
                assert log[i + 1] == ("record", "updates", entry[2])
        assert log[-1] == ("wait", "main", "updates") and log.count(("wait", "main", "updates")) == 1
        assert all(p.grad is None for p in model.parameters())
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    class Fails(torch.autograd.Function):  # a backward that raises after the last layer's updates were queued
        forward = staticmethod(lambda ctx, x: x.clone())
        backward = staticmethod(lambda ctx, grad: (_ for _ in ()).throw(RuntimeError("out of memory")))

    inputs, targets = _batches(1)[0]
    log.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        (model[2:](Fails.apply(model[:2](inputs))) - targets).square().mean().backward()
    assert [entry[0] for entry in log].count("update") == 4 and ("wait", "main", "updates") not in log
    beside.step()
    log.clear()
    _loss(model, _batches(1)[0]).backward()  # the next backward still ends waiting for its updates
    assert log[-1] == ("wait", "main", "updates")


def test_update_stream_is_made_only_for_one_cuda_device():
    from trainer_ext.optim.in_backward import update_stream

    params = list(_mlp().parameters())
    assert update_stream(params, True) is None  # the CPU
    assert create_optimizer(_mlp(), lr=0.01, in_backward=True, update_stream=True)._hooks.stream is None
    with pytest.raises(ValueError, match="update_stream"):
        LowMemoryAdafactor(params, update_stream="yes")
    if torch.cuda.is_available():
        cuda = [torch.nn.Parameter(torch.zeros(2, device="cuda"))]
        assert isinstance(update_stream(cuda, True), torch.cuda.Stream)
        assert update_stream(cuda, False) is None


# ----------------------------------------------------------------------------- non-finite gradients


@pytest.mark.parametrize("in_backward", [False, True])
def test_nan_gradient_skips_only_that_tensor(in_backward):
    model = _mlp()
    optimizer = create_optimizer(model, lr=0.01, in_backward=in_backward, max_consecutive_skips=3)
    poisoned = model[2].weight
    hook = poisoned.register_hook(lambda grad: grad * float("nan"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _loss(model, _batches(1)[0]).backward()
    optimizer.step()
    optimizer.zero_grad()
    assert torch.equal(poisoned, before["2.weight"])
    assert int(optimizer.state[poisoned]["step"]) == 0
    assert not torch.isnan(optimizer.state[poisoned]["row"]).any()
    assert not torch.equal(model[0].weight, before["0.weight"])
    assert optimizer.last_step_skips == 1 and optimizer.skipped_updates == 1
    assert math.isnan(optimizer.last_grad_norm)

    # A clean step resets the consecutive count; three poisoned steps in a row stop training.
    hook.remove()
    _train(model, optimizer, None, _batches(1, seed=2))
    assert optimizer.last_step_skips == 0 and optimizer.skipped_updates == 1
    model[0].bias.register_hook(lambda grad: grad * float("inf"))
    _train(model, optimizer, None, _batches(2, seed=3))
    with pytest.raises(RuntimeError, match="consecutive"):
        _train(model, optimizer, None, _batches(1, seed=4))
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("subspace", [None, dict(momentum_rank_fraction=0.25, projection_interval=2)])
@pytest.mark.parametrize("in_backward", [False, True])
def test_state_dict_round_trip_gives_identical_training(in_backward, subspace, one_thread):
    # With subspace momentum the bases are refreshed at steps 0, 2 and 4: one before and one after the resume.
    options = dict(lr=0.01, weight_decay=0.1, momentum=0.9, in_backward=in_backward, max_chunk_numel=100,
                   **(subspace or {}))
    batches = _batches(6, dtype=torch.bfloat16)
    schedule = lambda step: 1.0 / (1 + step)  # noqa: E731

    def build(model, **extra):
        optimizer = create_optimizer(model, **options, **extra)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    model = _mlp(torch.bfloat16)
    _train(model, *build(model), batches)

    first = _mlp(torch.bfloat16)
    optimizer, scheduler = build(first)
    _train(first, optimizer, scheduler, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    resumed = _mlp(torch.bfloat16, seed=123)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer, resumed_scheduler = build(resumed)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    resumed_scheduler.load_state_dict(checkpoint["scheduler"])
    assert resumed_optimizer.state[resumed[0].weight]["row"].dtype == torch.float32
    _train(resumed, resumed_optimizer, resumed_scheduler, batches[3:])

    for a, b in zip(model.parameters(), resumed.parameters()):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b)
    # Stochastic rounding depends on the seed, which the checkpoint carries.
    other_seed = _mlp(torch.bfloat16)
    _train(other_seed, *build(other_seed, seed=7), batches)
    assert not torch.equal(other_seed[2].weight, model[2].weight)


def test_a_checkpoint_from_before_the_residual_scale_resumes_with_the_update_it_was_trained_with():
    weight = nn.Parameter(torch.randn(8, 6))
    saved = LowMemoryAdafactor([weight], momentum=0.9, momentum_rank_fraction=0.25).state_dict()
    for group in saved["param_groups"]:
        del group["subspace_residual"]  # as written before the field existed
    resumed = LowMemoryAdafactor([weight], momentum=0.9, momentum_rank_fraction=0.25, subspace_residual=0.25)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["subspace_residual"] == 1.0
    weight.grad = torch.randn(8, 6)
    resumed.step()  # and it steps with it


# ----------------------------------------------------------------------------- end to end


def test_small_bf16_model_trains_in_backward(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1)).to(torch.bfloat16)
    optimizer = create_optimizer(model, lr=3e-3, weight_decay=0.01, in_backward=True, momentum=0.9)
    true_weight = torch.randn(16, 1)
    inputs = torch.randn(64, 16)
    targets = inputs @ true_weight
    losses = []
    for _ in range(150):
        loss = (model(inputs.bfloat16()).float() - targets).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        for value in optimizer.state[p].values():
            assert not (value.dtype == torch.float32 and p.ndim >= 2 and value.shape == p.shape)


def test_invalid_arguments_are_value_errors():
    weight = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="lr"):
        LowMemoryAdafactor([weight], lr=-1.0)
    with pytest.raises(ValueError, match="beta2"):
        LowMemoryAdafactor([weight], beta2=1.0)
    with pytest.raises(ValueError, match="momentum"):
        LowMemoryAdafactor([weight], momentum=1.5)
    with pytest.raises(ValueError, match="momentum_rank_fraction"):
        LowMemoryAdafactor([weight], momentum=0.9, momentum_rank_fraction=1.0)
    with pytest.raises(ValueError, match="projection_interval"):
        LowMemoryAdafactor([weight], momentum=0.9, momentum_rank_fraction=0.5, projection_interval=0)
    with pytest.raises(ValueError, match="subspace_residual"):
        LowMemoryAdafactor([weight], momentum=0.9, momentum_rank_fraction=0.5, subspace_residual=-0.1)
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float32"):
        LowMemoryAdafactor([nn.Parameter(torch.zeros(2, dtype=torch.float16))])


# ----------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_update_matches_eager_on_gpu():
    torch.manual_seed(0)
    shapes = [(256, 96), (2, 64, 48), (96,)]
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(3)]
    results = []
    runs = [(compile_, chunk, fraction) for fraction in (None, 0.25)
            for compile_, chunk in [(False, 2**24), (True, 2**24), (True, 1000)]]
    for compile_, chunk, fraction in runs:
        params = [nn.Parameter(torch.ones(s, device="cuda")) for s in shapes]
        optimizer = LowMemoryAdafactor(params, lr=0.01, momentum=0.9, weight_decay=0.1, compile=compile_, fused=False,
                                       max_chunk_numel=chunk, momentum_rank_fraction=fraction,
                                       projection_interval=2)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            optimizer.step()
        results.append(params)
    for reference, compiled in [(0, 1), (0, 2), (3, 4), (3, 5)]:
        for a, b in zip(results[reference], results[compiled]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fraction", [None, 0.25])
def test_updates_on_their_own_stream_equal_those_on_backwards_on_gpu(fraction):
    runs = []
    for stream in (False, True):
        model = _mlp(torch.bfloat16).cuda()
        optimizer = create_optimizer(model, lr=0.01, weight_decay=0.1, in_backward=True, momentum=0.9,
                                     momentum_rank_fraction=fraction, projection_interval=2, update_stream=stream)
        assert (optimizer._hooks.stream is not None) == stream
        for batch in _batches(4, torch.bfloat16):
            _loss(model, [t.cuda() for t in batch]).backward()
            optimizer.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
