"""INT8 weights for HMT (``method.weight_dtype=int8``, hmt_core.int8_weights): the codec's error bound, stochastic
rounding's unbiasedness and determinism, the custom autograd Linear against ``nn.Linear`` on the dequantized weight,
dequantize-again under activation recompute, the meter's attribution, training close to BF16, bit-identical resume
and dry-run fidelity."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import tiny_llama
from torch import nn
from torch.utils.checkpoint import checkpoint

from experiments.checkpoint import store as ck
from hmt_core import hmt, int8_weights
from hmt_core.int8_weights import Int8Linear, dequantize, quantize
from hmt_core.precision import stochastic_round_int

U32 = 2.0 ** -24  # fp32 unit roundoff
U16 = 2.0 ** -8  # bf16 unit roundoff (8 significant bits)


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A Llama-init-like weight (std 0.02) with an outlier column and an all-zero block."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    w[:, 3] *= 40.0  # one outlier input feature: it widens only its own block's step
    w[0, :32] = 0.0
    return w


# ------------------------------------------------------------------------------------------------------ codec
def test_quantization_error_is_bounded_by_the_block_scale():
    """Round-to-nearest: q = round(fl(W/s)) with |fl(W/s) − W/s| ≤ 127u (u = 2⁻²⁴), so |q − W/s| ≤ 1/2 + 127u, and
    the fp32 product q·s adds ≤ 127u·s: |Ŵ − W| ≤ s(1/2 + 254u) per element, s its block's scale. Stochastic
    rounding moves to either neighbour: < s(1 + 254u). A bf16 output adds its rounding, ≤ u₁₆|Ŵ|."""
    block = 32
    w = _weight(24, 80)  # 80 = 2 whole blocks + a tail of 16 per row
    q, s = quantize(w, block)
    assert q.dtype == torch.int8 and s.shape == (24, 3) and int(q.abs().max()) <= 127
    s_full = s.repeat_interleave(block, dim=1)[:, :80].double()
    assert torch.equal(s[0, 0], torch.tensor(1.0)) and bool((q[0, :32] == 0).all())  # all-zero block: scale 1
    err = (dequantize(q, s, block, torch.float32).double() - w.double()).abs()
    assert float((err / (s_full * (0.5 + 254 * U32))).max()) <= 1.0, float((err / s_full).max())
    assert float((err / s_full).max()) > 0.4  # the bound is tight: an error near s/2 occurs
    absmax = w.abs().reshape(24, -1)[:, :64].reshape(24, 2, 32).amax(2)
    assert torch.equal(s[:, :2], torch.where(absmax > 0, absmax / 127, 1.0))  # per block, along the input dim
    assert bool((q.abs().reshape(24, -1)[:, :64].reshape(24, 2, 32).amax(2)[1:] == 127).all())  # absmax -> ±127
    outlier_free = s[:, 1].double().mean() / s[:, 0].double().mean()  # block 0 holds the outlier column
    assert outlier_free < 0.2, outlier_free
    q_sr, s_sr = quantize(w, block, torch.Generator().manual_seed(0), stochastic=True)
    assert torch.equal(s_sr, s)
    err_sr = (dequantize(q_sr, s_sr, block, torch.float32).double() - w.double()).abs()
    assert float((err_sr / (s_full * (1 + 254 * U32))).max()) < 1.0
    bf = dequantize(q, s, block, torch.bfloat16).double()
    assert float(((bf - w.double()).abs() - s_full * (0.5 + 254 * U32) - U16 * bf.abs()).max()) <= 0.0


def test_integer_stochastic_rounding_is_unbiased_and_seeded():
    """Each of M values y = k + p is rounded N times; a rounding is k + 1 with probability p (Bernoulli), so the mean
    of N roundings has expectation y (up to the draw's bias < 2⁻¹⁵, 0.01σ here) and standard error
    σ = √(p(1 − p)/N). With p ∈ [1/16, 15/16], Np ≥ 256 and the mean is Gaussian to good accuracy: |mean − y| ≤ 6σ
    fails for one value with probability 2·10⁻⁹ (≈ 10⁻⁶ for all M). Round-to-nearest (negative control) is off by
    up to 1/2 ≫ 6σ ≈ 0.03."""
    gen = torch.Generator().manual_seed(1)
    m, n = 512, 4096
    k = torch.randint(-127, 127, (m,), generator=gen).float()
    p = 1 / 16 + torch.rand(m, generator=gen) * (14 / 16)
    y = k + p
    draws = stochastic_round_int(y.expand(n, m).contiguous(), torch.Generator().manual_seed(0)).double()
    assert bool(((draws == k.double()) | (draws == k.double() + 1)).all())  # only the two neighbours
    frac = (y.double() - torch.floor(y).double())  # the fraction of the fp32 value actually rounded
    sigma = torch.sqrt(frac * (1 - frac) / n)
    z = (draws.mean(0) - y.double()).abs() / sigma
    assert float(z.max()) < 6.0, float(z.max())
    assert float(((torch.round(y).double() - y.double()).abs() / sigma).max()) > 6.0
    exact = torch.arange(-127, 128).float()
    assert torch.equal(stochastic_round_int(exact, torch.Generator().manual_seed(3)), exact)  # integers stay
    a = stochastic_round_int(y, torch.Generator().manual_seed(5))
    assert torch.equal(a, stochastic_round_int(y, torch.Generator().manual_seed(5)))
    assert not torch.equal(a, stochastic_round_int(y, torch.Generator().manual_seed(6)))


def test_int8_weight_update_is_unbiased_through_the_writer():
    """An update far below the quantization step (lr·1 ≪ s) survives in expectation: the mean over N writes of
    Ŵ(after) − Ŵ(before) equals the fp32 update within 6 standard errors s·√(p(1 − p)/N) per element."""
    from hmt_core.precision import UpdateWriter

    torch.manual_seed(0)
    layer = Int8Linear.from_module(nn.Linear(64, 16, bias=False), block=32)
    handle, writer = layer.handle, UpdateWriter(seed=7)
    before = layer.dequantized(torch.float32)
    delta, n = 1e-5, 2000  # the step s is ≈ 1e-3 here: p ≈ 0.01 per write
    total = torch.zeros(before.shape, dtype=torch.float64)
    codes, scales = layer.weight_codes.clone(), layer.weight_scales.clone()
    for _ in range(n):  # n independent writes of the same update from the same state
        layer.weight_codes.data.copy_(codes)
        layer.weight_scales.data.copy_(scales)
        for index in writer.spans(handle, None):
            with writer.rows(handle.data, None, index) as w:
                w.add_(delta)
        total += layer.dequantized(torch.float32).double() - before.double()
    # each write rounds y = fl((Ŵ + δ)/s') on the grid of the new scale s' (its block's absmax changed by δ)
    s_new = int8_weights.block_absmax(before + delta, 32).div(127).repeat_interleave(32, dim=1)
    y = ((before + delta) / s_new).double()
    p = y - torch.floor(y)
    sigma = s_new.double() * torch.sqrt(p * (1 - p) / n)
    tol = 6 * sigma + 256 * U32 * s_new.double()  # + the fp32 roundings of y and of the products (≤ 127u·s each)
    excess = (total / n - delta).abs() - tol
    assert float(excess.max()) <= 0.0, float(((total / n - delta).abs() / sigma.clamp(min=1e-30)).max())
    # over all 1024 elements the mean drift has a standard error ≈ 1e-4/√(2·10⁶) = 7e-8 = 0.7% of δ: 5% is 7σ
    assert abs(float((total / n).mean()) / delta - 1) < 0.05, float((total / n).mean())
    assert float((before.double() + delta - layer.dequantized(torch.float32).double()).abs().max()) < float(
        s_new.max())  # one write moves each element to a neighbour of Ŵ + δ


# ----------------------------------------------------------------------------------------------- custom Linear
def _bound(a: torch.Tensor, b: torch.Tensor, k: int, bf16_out: bool, extra: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-element tolerance of two products A·B (+ ``extra``: a bias term's magnitude) of the same operands computed
    in different orders: each side's fp32 accumulation of k (+1) terms errs by ≤ (k + 1)·u·(|A|·|B| + |bias|) (γ_k),
    and a bf16 result adds ≤ u₁₆ of its magnitude on each side."""
    mag = a.double().abs() @ b.double().abs() + extra
    return mag * (2 * (k + 1) * U32 + (2 * U16 * (1 + (k + 1) * U32) if bf16_out else 0.0))


def _check_linear(dtype: torch.dtype, autocast: bool, conv1d: bool) -> None:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    rows, cols = (80, 48) if conv1d else (48, 80)  # in 80, out 48, block 32 (ragged)
    src = Conv1D(48, 80) if conv1d else nn.Linear(80, 48)
    src = src.to(dtype)
    with torch.no_grad():
        src.weight.normal_(0, 0.02)
        src.bias.normal_(0, 0.02)
    layer = Int8Linear.from_module(src, block=32)
    assert layer.transposed == conv1d and layer.weight.shape == (rows, cols)
    ref = Conv1D(48, 80).to(dtype) if conv1d else nn.Linear(80, 48).to(dtype)
    with torch.no_grad():  # the reference: a plain layer on the dequantized weight, same bias
        ref.weight.copy_(layer.dequantized(dtype))
        ref.bias.copy_(layer.bias)
    fired = []
    layer.handle.register_post_accumulate_grad_hook(lambda h: fired.append(h.grad.shape))
    x = torch.randn(2, 5, 80, dtype=dtype)
    outs, grads = [], []
    for net in (layer, ref):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = net(xi)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
        outs.append(out.detach())
        grads.append((xi.grad, net.weight.grad, net.bias.grad))
    assert fired == [torch.Size((rows, cols))]  # the hook fires once, on the full-size weight gradient
    assert outs[0].dtype == outs[1].dtype and grads[0][1].dtype == dtype
    low = autocast or dtype == torch.bfloat16
    cd = torch.bfloat16 if autocast else dtype
    w = ref.weight.detach().to(cd)
    wt = w if conv1d else w.t()  # (in, out)
    g = torch.linspace(-1, 1, outs[1].numel()).reshape(outs[1].shape).to(cd).reshape(-1, 48)
    x2 = x.to(cd).reshape(-1, 80)
    bias = ref.bias.detach().to(cd).double().abs()
    rows_ = [("out", outs[0].reshape(-1, 48), outs[1].reshape(-1, 48), _bound(x2, wt, 80, low, bias)),
             ("grad x", grads[0][0].reshape(-1, 80), grads[1][0].reshape(-1, 80), _bound(g, wt.t(), 48, low)),
             ("grad w", grads[0][1], grads[1][1],
              _bound(x2.t(), g, 10, low) if conv1d else _bound(g.t(), x2, 10, low)),
             ("grad b", grads[0][2], grads[1][2], g.double().abs().sum(0) * (2 * 11 * U32 + (2 * U16 if low else 0)))]
    for name, a, b, tol in rows_:
        excess = (a.double() - b.double()).abs() - tol
        assert float(excess.max()) <= 0.0, (name, float((a.double() - b.double()).abs().max()))


def test_custom_linear_equals_plain_linear_on_the_dequantized_weight():
    """Forward, input/weight/bias gradients of ``Int8Linear`` against ``nn.Linear`` / ``Conv1D`` holding the
    dequantized weight: fp32, bf16, fp32 weights under bf16 autocast, and the (in, out) Conv1D layout. The two run
    the same products in possibly different orders: per element |a − b| ≤ 2(k + 1)·u·(|A|·|B| + |bias|) (+ 2u₁₆ of
    that magnitude with bf16 results), ``_bound``."""
    for dtype, autocast, conv1d in ((torch.float32, False, False), (torch.bfloat16, False, False),
                                    (torch.float32, True, False), (torch.float32, False, True)):
        _check_linear(dtype, autocast, conv1d)


def test_autograd_grad_on_other_inputs_fires_no_update_hook():
    """The activation probe takes gradients with ``torch.autograd.grad``: an INT8 weight's hook must not fire."""
    layer = Int8Linear.from_module(nn.Linear(16, 8))
    fired = []
    layer.handle.register_post_accumulate_grad_hook(lambda h: fired.append(1))
    x = torch.randn(3, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).sum(), [x])
    assert gx.shape == x.shape and not fired and layer.weight.grad is None


def test_recompute_dequantizes_again_and_saves_no_weight_copy(monkeypatch):
    """Without recompute a layer dequantizes twice per step (forward, backward) and autograd saves only its input;
    under non-reentrant activation checkpointing (what ``activation=full_ckpt`` uses) the recomputed forward
    dequantizes a third time instead of keeping the copy, and the gradients are unchanged (same ops, bit for bit)."""
    torch.manual_seed(0)
    layer = Int8Linear.from_module(nn.Linear(64, 32, bias=False))
    calls = []
    original = Int8Linear.dequantized
    monkeypatch.setattr(Int8Linear, "dequantized", lambda self, dtype: calls.append(1) or original(self, dtype))
    saved = []
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = layer(x)
    assert saved == [(4, 64)] and len(calls) == 1  # the input only; the (32, 64) copy died with forward
    out.sum().backward()
    plain = (layer.weight.grad.clone(), x.grad.clone())
    assert len(calls) == 2
    layer.weight.grad, x.grad, calls[:] = None, None, []
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert len(calls) == 3
    assert torch.equal(layer.weight.grad, plain[0]) and torch.equal(x.grad, plain[1])


@pytest.mark.parametrize("kw,clip,micro", [
    (dict(mode="A", per_layer=True), 1.0, 1),  # deferred (clipped) low-rank updates in finish_step
    (dict(mode="A", per_layer=True), None, 2),  # in-hook updates, two micro-batches
    (dict(mode="A", per_layer=False, sides="two_sided"), 1.0, 1),
    (dict(mode="B", per_layer=True, basis="random"), None, 2),  # Mode B: full gradients accumulate
    (dict(mode="B", per_layer=False, basis="random", scaling="tensor"), 1.0, 1),
    (dict(mode="A", sides="identity", scale=1.0, per_layer=True), None, 1),
], ids=["A-deferred", "A-hook-accum2", "A-ordinary-two_sided", "B-per_layer-accum2", "B-ordinary", "A-identity"])
def test_every_update_path_requantizes_the_intended_update(kw, clip, micro, monkeypatch):
    """Through every update path (per-layer hooks, deferred clipped updates, the ordinary step, Mode B, gradient
    accumulation, row chunks — forced to 16 rows), each INT8 weight's rows are written exactly once per step, and
    the stored weight is a stochastic rounding of Ŵ + ΔW*, ΔW* the fp32 update the optimizer computed (the writer's
    probe): |Ŵ_new − (Ŵ + ΔW*)| < s_new, one quantization step of the new scale (+ fp32 roundings, 256u·s)."""
    from helpers import batches, lm_step

    from hmt_core import precision
    monkeypatch.setattr(precision, "write_rows", lambda shape, chunk_bytes=None, like=None: [
        slice(a, min(a + 16, shape[0])) for a in range(0, shape[0], 16)])
    model = tiny_llama(dtype=torch.bfloat16)
    method = hmt.make(hmt.Config(weight_dtype="int8", rank=8, update_interval=2, lr=1e-3, **kw))
    method.prepare(model)
    method.attach(model, max_grad_norm=clip)
    layers = {m.handle: m for m in int8_weights.int8_layers(model)}
    for step, x in enumerate(batches(2, batch=2 * micro)):
        deltas = {h: torch.zeros(h.shape) for h in layers}
        writes = {h: torch.zeros(h.shape[0]) for h in layers}

        def probe(param, index, delta, deltas=deltas, writes=writes):
            if not isinstance(param, int8_weights.Int8Weight):
                return  # a BF16 weight (embedding, norms, lm_head)
            deltas[param][index] += delta
            writes[param][index] += 1

        method.opt.writer.probe = probe
        before = {h: m.dequantized(torch.float32) for h, m in layers.items()}
        lm_step(model, method.step, method.zero_grad, method.start_micro_batch, micro)(x)
        for h, m in layers.items():
            assert bool((writes[h] == 1).all()), (step, m)
            assert float(deltas[h].abs().max()) > 0
            s_new = m.weight_scales.repeat_interleave(m.block, dim=1)[:, :h.shape[1]].double()
            err = (m.dequantized(torch.float32).double() - (before[h] + deltas[h]).double()).abs()
            assert float((err - s_new * (1 + 256 * U32)).max()) < 0, (step, float((err / s_new).max()))


# ------------------------------------------------------------------------------------- fused write of INT8 rows
def _rows_and_update(rows: int = 19, cols: int = 300, block: int = 128):
    w = _weight(rows, cols)
    q, s = quantize(w, block)
    u = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)) * 0.05
    return q, s, u, block


@pytest.mark.parametrize("style,wd", [("torch", 0.0), ("torch", 0.1), ("hf", 0.1)])
def test_fused_int8_update_fallback_is_the_writers_round_trip(style, wd):
    """``int8_update`` (PyTorch fallback) with noise drawn first from the writer's generator equals the writer's
    unfused round trip (``read_rows`` → ``apply_update_`` → ``write_rows``) bit for bit: the same ops in the same
    order, and the same random draws (nothing else draws in between)."""
    from hmt_core.adam import apply_update_
    from hmt_core.precision import UpdateWriter

    q, s, u, block = _rows_and_update()
    layer = Int8Linear(q.clone(), s.clone(), None, dtype=torch.float32, block=block, backend="torch")
    twin = Int8Linear(q.clone(), s.clone(), None, dtype=torch.float32, block=block, backend="torch")
    kw = dict(step_size=0.02, lr=0.01, weight_decay=wd, style=style)
    a, b = UpdateWriter(seed=5), UpdateWriter(seed=5)
    index = slice(2, 17)
    with a.rows(layer.handle, None, index) as w:
        apply_update_(w, u[index], **kw)
    assert not b.fused(twin.handle, u)  # CPU tensors, torch backend: the unfused path is the optimizer's
    b.write_update(twin.handle, index, u[index], **kw)
    assert torch.equal(layer.weight_codes, twin.weight_codes) and torch.equal(layer.weight_scales, twin.weight_scales)
    assert not torch.equal(layer.weight_codes, q)


@pytest.mark.parametrize("decay_after,decay", [(False, 0.0), (False, 1e-3), (True, 1e-3)])
def test_fused_int8_update_kernel_equals_the_fallback(decay_after, decay):
    """The Triton kernel (interpreter) against its PyTorch fallback from the same codes, scales, update and noise.
    Tolerance: the only difference allowed is the fp32 rounding of W − c·U (the fallback's CPU ``add_`` may use a
    fused multiply-add, the interpreter does not): one ulp of a block's absmax moves its scale by ≤ 2u relative
    (scales: rtol 4u), and moves y = W/s by ≤ 127·2u, which flips a stochastic-rounding comparison (noise vs a
    threshold in units of 2⁻¹⁶) with probability < 2⁻⁷ per element: at most 1% of the codes may differ, by 1."""
    from hmt_core.int8_weights import codec
    from hmt_core.precision import random_halfwords

    q, s, u, block = _rows_and_update()
    noise = random_halfwords(u.shape, torch.Generator().manual_seed(9), device=u.device)
    out = {}
    for backend in ("torch", "triton"):
        q2, s2 = q.clone(), s.clone()
        codec.int8_update(q2, s2, u, noise, block, step_size=1e-2, decay=decay, decay_after=decay_after,
                          backend=backend)
        out[backend] = (q2, s2)
    (qt, st), (qk, sk) = out["torch"], out["triton"]
    torch.testing.assert_close(sk, st, rtol=4 * U32, atol=0)
    diff = (qk.int() - qt.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 0.01, (int(diff.max()), int(diff.sum()))
    assert float((qt != q).float().mean()) > 0.3  # the update moved many codes (measured: 47%)


def test_optimizer_writes_int8_rows_with_one_fused_kernel(monkeypatch):
    """With the kernel running (``kernels=triton``, interpreter), an INT8 weight's Mode A and Mode B writes are one
    ``hmt::int8_update_`` per row chunk (no dequantize/quantize round trip), and after a step from the same state
    the codes match the unfused write's (the same run with the fused write switched off) within one code on at
    most 1% of them (the tolerance above: the update's fp32 roundings differ, Mode A's reconstruction is a
    torch.matmul instead of the fused update kernel's tile product)."""
    from experiments.dispatch_counter import DispatchCounter

    for mode in ("A", "B"):
        codes = {}
        for fuse in (False, True):
            if not fuse:
                monkeypatch.setattr(int8_weights.Int8Weight, "fuses_update", lambda self, update: False)
            torch.manual_seed(0)
            net = nn.ModuleDict({"mlp": nn.Linear(96, 40, bias=False)})
            method = hmt.make(hmt.Config(weight_dtype="int8", rank=4, mode=mode, kernels="triton", lr=1e-2))
            method.prepare(net)
            method.attach(net, max_grad_norm=None)
            x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
            counter = DispatchCounter()
            with counter:
                net["mlp"](x).square().sum().backward()
                method.step()
            monkeypatch.undo()
            seen = Counter()
            for names in counter.report().op_names.values():
                seen.update(names)
            assert seen["hmt.int8_update_"] == int(fuse), (mode, fuse, seen)
            if fuse:
                assert seen["aten.amax"] == 0 and seen["aten.randint"] == 1, seen
            codes[fuse] = net["mlp"].weight_codes.clone()
        diff = (codes[True].int() - codes[False].int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 0.01, (mode, int(diff.sum()))


# ------------------------------------------------------------------------------------- model level: meter, memory
def _forward_activations(model: nn.Module, policy: str) -> int:
    from experiments.memory.meter import MemoryMeter
    from hmt_core.activations import apply_policy
    from hmt_core.activations.policy import PRESETS

    handle = apply_policy(model, PRESETS[policy]) if policy != "none" else None
    meter = MemoryMeter()
    meter.track(model.parameters(), "params")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with meter, meter.phase("forward"):
        loss = model(input_ids=ids, labels=ids).loss
    saved = meter.report().current_by_category_bytes["activations"]
    del loss
    if handle is not None:
        handle.remove()
    return saved


def test_meter_counts_codes_and_scales_as_params_and_forward_saves_what_bf16_saves():
    """The meter's ``params`` are the model's parameters byte for byte — INT8 codes (1 B/element), fp32 scales (one
    per block), the non-projected BF16 weights, 2 bytes per phantom — and what forward leaves for backward (the
    ``activations`` category) is exactly the BF16 model's, with and without full activation checkpointing: no
    dequantized weight is kept. ``count_params`` counts an INT8 weight's logical elements, like the BF16 model."""
    from experiments.memory.meter import MemoryMeter
    from experiments.models import count_params

    bf16, int8 = tiny_llama(dtype=torch.bfloat16), tiny_llama(dtype=torch.bfloat16)
    method = hmt.make(hmt.Config(weight_dtype="int8", rank=8))
    method.prepare(int8)
    layers = int8_weights.int8_layers(int8)
    assert len(layers) == 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head stays bf16
    assert count_params(int8) == count_params(bf16)
    meter = MemoryMeter()
    meter.track(int8.parameters(), "params")
    codes = sum(m.weight_codes.numel() for m in layers)
    scales = sum(m.weight_scales.numel() * 4 for m in layers)
    other = sum(p.numel() * 2 for p in int8.parameters() if int8_weights.role(p) is None)
    assert meter.report().current_by_category_bytes["params"] == codes + scales + other + 2 * len(layers)
    proj = sum(p.numel() for n, p in bf16.named_parameters() if n in {f"{n2}.weight" for n2, m in
               int8.named_modules() if isinstance(m, Int8Linear)})
    assert codes == proj and scales == 4 * sum(-(-m.in_features // 256) * m.out_features for m in layers)
    for policy in ("none", "full_ckpt"):
        assert _forward_activations(int8, policy) == _forward_activations(bf16, policy), policy


def test_state_dict_exports_the_dequantized_weight_and_loads_back():
    """``state_dict()`` carries the dequantized weight as ``weight`` (what ``train.save_model`` exports with
    ``save_pretrained``), beside the codes and scales: a plain BF16 model loads it and computes the same logits; an
    INT8 model loads the codes and scales exactly (parameter order unchanged), and from a plain model's state it
    quantizes the weights — to the same codes here: before any update each scale is a BF16 absmax / 127, so
    bf16(127·s) is that absmax again, and bf16(q·s) is within |q·s|·2⁻⁹ ≤ s/4 of q·s, which rounds back to q."""
    model = tiny_llama(dtype=torch.bfloat16)
    hmt.make(hmt.Config(weight_dtype="int8")).prepare(model)
    state = model.state_dict()
    layer = model.model.layers[1].mlp.down_proj
    assert torch.equal(state["model.layers.1.mlp.down_proj.weight"], layer.dequantized(torch.bfloat16))
    plain = tiny_llama(seed=5, dtype=torch.bfloat16)
    keys = plain.load_state_dict(state, strict=False)
    assert not keys.missing_keys and all(k.endswith(("_codes", "_scales")) for k in keys.unexpected_keys)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, model(input_ids=ids).logits)
    for source in (state, plain.state_dict()):
        twin = tiny_llama(seed=7, dtype=torch.bfloat16)
        hmt.make(hmt.Config(weight_dtype="int8")).prepare(twin)
        order = [n for n, _ in twin.named_parameters()]
        twin.load_state_dict(source)
        assert [n for n, _ in twin.named_parameters()] == order
        for (n, a), b in zip(model.named_parameters(), twin.parameters()):
            assert int8_weights.is_phantom(a) or torch.equal(a, b), n


def test_bad_settings_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="method.weight_dtype must be one of"):
        hmt.Config(weight_dtype="int4")
    with pytest.raises(ValueError, match="master_weights"):
        hmt.Config(weight_dtype="int8", master_weights=True)
    model = tiny_llama(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="call prepare"):
        hmt.make(hmt.Config(weight_dtype="int8")).attach(model, max_grad_norm=None)
    tied = tiny_llama(dtype=torch.bfloat16)
    tied.model.layers[0].mlp.up_proj.weight = tied.model.layers[0].mlp.gate_proj.weight
    with pytest.raises(ValueError, match="shared with another module"):
        hmt.make(hmt.Config(weight_dtype="int8")).prepare(tied)


# ------------------------------------------------------------------------------------- training, resume, dry run
MICRO = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=176, vocab_size=512)


def _train(weight_dtype: str, steps: int, *, root=None, every: int = 0, kill_after: int | None = None,
           resume=None, drop_generator: bool = False, method_extra: dict | None = None):
    """The real corpus, model, method and loop (``experiments.loop.run_training``) on a micro Llama; returns
    (per-step train losses, the run's result, the model). ``kill_after``: the process "dies" once that step is
    logged (an exception abandons every object); ``resume``: fresh objects restored from that checkpoint directory
    (``drop_generator``: without the stochastic-rounding generator's state, a negative control)."""
    from experiments import methods
    from experiments.checkpoint.manager import Checkpointer, ResumePoint
    from experiments.config import ModelConfig, TrainConfig
    from experiments.data.corpus import build_corpus
    from experiments.loop import run_training
    from experiments.memory.meter import MemoryMeter
    from experiments.models import build_model

    torch.manual_seed(0)
    cfg = TrainConfig(steps=steps, seq_len=32, batch_size=2, warmup_steps=steps // 10, log_every=1,
                      eval_every=steps, eval_batches=4, progress=False, checkpoint_every=every)
    corpus = build_corpus(path=None, text_field="text", val_fraction=0.05, vocab_size=512, seq_len=32,
                          batch_size=2, seed=0, cache_dir="~/.cache/hmt")
    model = build_model(ModelConfig(**MICRO), vocab_size=corpus.vocab_size)
    method = methods.make_method(methods.make_config({"name": "hmt", "weight_dtype": weight_dtype,
                                                      "rank_candidates": (8, 16), "update_interval": 4,
                                                      **(method_extra or {})}))
    model = method.prepare(model)
    method.attach(model, max_grad_norm=1.0)
    checkpointer = Checkpointer(root, every=every, keep=0, model=model, method=method, meta={}) if root else None
    state = None
    if resume is not None:
        path, manifest = resume, ck.verify(resume)
        if drop_generator:
            restore = method.load_state_dict
            method.load_state_dict = lambda st: restore({**st, "precision": None})
        state = checkpointer.restore(ResumePoint(path, manifest, []), torch.device("cpu"))
    losses = {}

    class Killed(Exception):
        pass

    def log(record):
        losses[record["step"]] = record["loss/train"]
        if record["step"] == kill_after:
            raise Killed

    try:
        result = run_training(model, method, corpus, cfg, torch.device("cpu"), log=log, meter=MemoryMeter(),
                              checkpointer=checkpointer, state=state)
    except Killed:
        result = None
    return losses, result, model


def test_int8_training_tracks_bf16_on_a_micro_model():
    """40 steps of HMT on a micro Llama (hidden 64, 2 layers, built-in corpus), BF16 vs INT8 weights from the same
    initialization and batches: the final validation losses agree within 3% (the 200-step tiny comparison of
    docs/memory_savings.md is in ``benchmarks/int8_bench.py``; measured here: 0.1%). The same 3% as the 200-step
    target: a wrong dequantization or a lost update would show at once (at step 0 the loss is ln 512 ≈ 6.2; training
    reaches ≈ 5.2, so 3% ≈ 0.16 is a sixth of what these steps learn)."""
    losses = {wd: _train(wd, 40) for wd in ("bf16", "int8")}
    val = {wd: r.val_loss for wd, (_, r, _) in losses.items()}
    first = losses["bf16"][0][0]
    assert abs(val["int8"] - val["bf16"]) / val["bf16"] < 0.03, val
    assert first - val["bf16"] > 3 * 0.03 * val["bf16"], (first, val)  # the bound is far below what was learned


def test_resume_after_a_kill_is_bit_identical(tmp_path):
    """Checkpoints every 3 steps; the run dies after logging step 7; fresh objects restored from the step-6
    checkpoint (INT8 codes and scales, method state with the stochastic-rounding generator, RNGs) continue: every
    loss and the final codes and scales equal the uninterrupted run's bit for bit. Restoring without the generator's
    state (negative control) draws other roundings and the codes differ."""
    ref_losses, ref, ref_model = _train("int8", 10)
    root = tmp_path / "ck"
    _train("int8", 10, root=root, every=3, kill_after=7)
    assert [p.name for _, p in ck.list_checkpoints(root)] == ["step-00000006", "step-00000003"]
    losses, result, model = _train("int8", 10, root=root, every=3, resume=root / "step-00000006")
    assert sorted(losses) == list(range(6, 10))
    assert all(losses[k] == ref_losses[k] for k in losses), (losses, ref_losses)
    assert result.val_loss == ref.val_loss
    codes = [(n, p) for n, p in model.named_parameters() if int8_weights.trained_in_place(p)]
    ref_params = dict(ref_model.named_parameters())
    assert len(codes) == 28 and all(torch.equal(p, ref_params[n]) for n, p in codes)
    _, _, other = _train("int8", 10, root=root, every=3, resume=root / "step-00000006", drop_generator=True)
    other_params = dict(other.named_parameters())
    assert not all(torch.equal(other_params[n], ref_params[n]) for n, _ in codes)


def _dry(*overrides):
    from test_dryrun_fidelity import _both, _run

    return _both(_run(*overrides))


def _assert_fake_matches_real(real: dict, fake: dict) -> None:
    r, f = real["report"], fake["report"]
    assert abs(f.peak_bytes - r.peak_bytes) <= 0.01 * r.peak_bytes, (f.peak_bytes, r.peak_bytes)
    for phase, value in r.peak_by_phase_bytes.items():
        assert abs(f.peak_by_phase_bytes[phase] - value) <= 0.01 * value, phase
    for key, value in r.peak_by_category_bytes.items():
        assert abs(f.peak_by_category_bytes[key] - value) <= 0.01 * value + 64, key
    assert fake["method_summary"]["int8/weight_bytes"] == real["method_summary"]["int8/weight_bytes"] > 0


def test_dry_run_traces_int8_and_equals_real_runs():
    """``mode=dryrun`` traces the INT8 step (conversion, dequantizations, the stochastic-rounding writes) and its
    figures equal a real CPU run's within 1% (equal to the byte here): the tiny model (Mode A, basis refreshes every
    step) and a 125M-width 2-layer model with the memory-minimal setting (Mode B rank 1, full
    checkpointing, the activation probe traced too). The INT8 step's ``params`` are below the BF16 step's."""
    tiny = ["model=tiny", "train.seq_len=64", "train.batch_size=2", "method=hmt", "method.rank=16",
            "method.update_interval=1"]
    real, fake = _dry(*tiny, "method.weight_dtype=int8")
    _assert_fake_matches_real(real, fake)
    params, bf16_bytes = fake["report"].peak_by_category_bytes["params"], 2 * fake["params_total"]
    assert params < 0.75 * bf16_bytes, (params, bf16_bytes)  # projected weights: 2 B -> 1 B + 4 B/256 per element
    wide = ["model=125m", "model.num_layers=2", "train.seq_len=256", "train.batch_size=1", "method=hmt",
            "method.mode=B", "method.basis=random", "method.scaling=tensor", "method.rank=1", "method.scale=128",
            "method.target_patterns=[attn,mlp,lm_head]", "method.state_dtype=bf16", "method.dense_8bit=true",
            "activation=full_ckpt", "train.max_grad_norm=0", "method.weight_dtype=int8"]
    real, fake = _dry(*wide)
    _assert_fake_matches_real(real, fake)
    assert fake["probe_peak_bytes"] is not None
    assert abs(fake["probe_peak_bytes"] - real["probe_peak_bytes"]) <= 0.01 * real["probe_peak_bytes"]
