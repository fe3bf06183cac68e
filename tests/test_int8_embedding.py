"""INT8 input embedding and LM head (``method.embedding_dtype=int8``, ``hmt_core.int8_weights.embedding``), the
fused loss on an INT8 head, and the 8-bit block-wise moments of a dense INT8 weight (``hmt_core.optim.moments8``)."""

from __future__ import annotations

import pytest
import torch
from helpers import batches, tiny_llama
from torch import nn
from torch.nn import functional as F

from hmt_core import fused_ce, hmt
from hmt_core.adam import apply_update_
from hmt_core.int8_weights import Int8Embedding, Int8Linear, dequantize, quantize
from hmt_core.kernels import ops as kops
from hmt_core.optim.moments8 import Moments8, dynamic_map
from hmt_core.hmt_config import optimizer_settings
from hmt_core.optim.optimizer import LowRankOptimizer, Slot


def _table(rows: int = 40, cols: int = 300, seed: int = 0, dtype=torch.bfloat16) -> nn.Embedding:
    torch.manual_seed(seed)
    emb = nn.Embedding(rows, cols, padding_idx=3)
    with torch.no_grad():
        emb.weight.normal_(0, 0.02)  # as a Llama embedding is initialized
    return emb.to(dtype)


def test_lookup_and_its_gradient_equal_plain_embedding_on_the_dequantized_table():
    """Same codes, same numbers: the INT8 lookup is ``F.embedding`` of the dequantized table bit for bit (forward
    gathers and dequantizes rows; elementwise, so the same values), and its backward is ``F.embedding``'s (the
    padding row's gradient zero); only the ids are saved for backward, and the table is never dequantized whole."""
    emb = _table()
    layer = Int8Embedding.from_module(emb)
    table = layer.dequantized(torch.bfloat16).requires_grad_(True)
    ids = torch.tensor([[0, 3, 5, 39], [5, 5, 1, 3]])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = layer(ids)
    ref = F.embedding(ids, table, padding_idx=3)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref), float((out.float() - ref.float()).abs().max())
    assert saved == [(2, 4)], saved
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(layer.weight.grad, table.grad)
    assert float(layer.weight.grad[3].abs().max()) == 0.0 and float(layer.weight.grad[5].abs().max()) > 0


def test_fused_loss_on_an_int8_head_equals_the_dequantized_head_and_dequantizes_blocks(monkeypatch):
    """The fused loss with an INT8 head (vocabulary blocks, log-sum-exps merged block by block) against the BF16
    path's fused loss on the dequantized weight, one call each from the same inputs, in fp32 so that only the order
    of the log-sum-exp's fp32 sums differs: loss and gradients within 2e-6 relative (a few fp32 ulps of lse ~ 5,
    carried through exp(z − lse)). Every dequantization is a block of rows, never the (V, H) weight."""
    torch.manual_seed(0)
    v, h, n = 96, 32, 12
    head = Int8Linear.from_module(nn.Linear(h, v, bias=False), block=16)
    weight = head.dequantized(torch.float32).requires_grad_(True)
    hidden = torch.randn(2, n // 2, h)
    labels = torch.randint(0, v, (2, n // 2))
    labels[0, 2] = fused_ce.IGNORE_INDEX
    shapes = []
    real = fused_ce.dequantize
    monkeypatch.setattr(fused_ce, "dequantize", lambda q, *a, **k: shapes.append(tuple(q.shape)) or real(q, *a, **k))
    x1, x2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    loss = fused_ce.linear_cross_entropy(x1, head.weight, None, labels, chunk_tokens=4, int8_head=head)
    ref = fused_ce.linear_cross_entropy(x2, weight, None, labels, chunk_tokens=4)
    loss.backward()
    ref.backward()
    loss, ref = float(loss.detach()), float(ref.detach())
    assert abs(loss - ref) <= 2e-6 * abs(ref), (loss, ref)
    for name, a, b in (("hidden", x1.grad, x2.grad), ("weight", head.weight.grad, weight.grad)):
        err = float((a - b).abs().max())
        assert err <= 2e-6 * float(b.abs().max()), (name, err, float(b.abs().max()))
    assert shapes and max(r for r, _ in shapes) < v, shapes  # (Vb, H) blocks: 4·96/12 = 32 rows


def test_the_dynamic_map_is_bitsandbytes_and_moments_round_to_the_nearest_code():
    """The maps are bitsandbytes' (``create_dynamic_map``, sorted); a stored moment is the map value nearest to
    x/absmax times its block's absmax (brute force over the 256 codes), the block's absmax itself exact."""
    from bitsandbytes.functional import create_dynamic_map

    for signed in (True, False):
        assert torch.equal(dynamic_map(signed), create_dynamic_map(signed=signed).sort().values), signed
    gen = torch.Generator().manual_seed(0)
    state = Moments8((5, 300), torch.device("cpu"), block=128)
    m = torch.randn(5, 300, generator=gen) * torch.logspace(-6, 0, 300)  # seven decades inside a row
    v = m.square()
    state.write(slice(0, 5), m, v)
    got = state.read(slice(0, 5))
    for k, (x, x_hat) in enumerate(zip((m, v), got)):
        for a in range(0, 300, 128):
            blk = x[:, a:a + 128]
            amax = blk.abs().amax(dim=1, keepdim=True)
            values = state.maps[k].view(1, 1, -1) * amax.unsqueeze(2)  # (5, 1, 256) candidates
            nearest = values.squeeze(1).gather(1, (values - blk.unsqueeze(2)).abs().argmin(dim=2))
            assert torch.equal(x_hat[:, a:a + 128], nearest), (k, a)


def _dense_step(layer: Int8Embedding, cfg: hmt.Config, grad: torch.Tensor) -> LowRankOptimizer:
    opt = LowRankOptimizer([Slot(name="embed", param=layer.handle, index=1, projected=False)], optimizer_settings(cfg))
    layer.weight.grad = grad
    opt.step_all(None)
    return opt


@pytest.mark.parametrize("dense_8bit", [False, True])
def test_a_dense_int8_embedding_update_is_dequantize_adamw_requantize(dense_8bit):
    """Two optimizer steps, each compared from the state it starts from: the stored codes and scales are exactly
    ``quantize(Ŵ − AdamW step, stochastic, the writer's seeded generator)``, Ŵ the dequantized table, the AdamW
    step computed by ``kops.adam_step`` from the moments the step starts from (BF16 for a BF16 table; with
    ``dense_8bit`` the 8-bit moments read back as fp32), and the 8-bit moments are the new fp32 moments stored."""
    layer = Int8Embedding.from_module(_table(rows=33))
    cfg = hmt.Config(lr=1e-2, weight_decay=0.1, dense_8bit=dense_8bit, seed=7)
    gen = torch.Generator().manual_seed(7)  # the writer's generator (seed = method.seed), first use here
    opt = None
    for step in (1, 2):
        grad = (torch.randn(33, 300, generator=torch.Generator().manual_seed(step)) * 1e-2).to(torch.bfloat16)
        w = dequantize(layer.weight_codes, layer.weight_scales, layer.block, torch.float32)
        if opt is None:
            m, v = (torch.zeros(33, 300), torch.zeros(33, 300)) if dense_8bit else (
                torch.zeros(33, 300, dtype=torch.bfloat16), torch.zeros(33, 300, dtype=torch.bfloat16))
        else:
            slot = opt.slots[0]
            m, v = opt.moments8["embed"].read(slice(0, 33)) if dense_8bit else (slot.m.clone(), slot.v.clone())
        d, step_size = kops.adam_step(m, v, grad.float(), step, lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2,
                                      eps=cfg.eps, style=cfg.adam_style, backend="torch")
        apply_update_(w, d, step_size=step_size, lr=cfg.lr, weight_decay=cfg.weight_decay, style=cfg.adam_style)
        codes, scales = quantize(w, layer.block, gen, stochastic=True)
        if opt is None:
            opt = _dense_step(layer, cfg, grad)
        else:
            layer.weight.grad = grad
            opt.step_all(None)
        assert torch.equal(layer.weight_codes, codes), (step, int((layer.weight_codes != codes).sum()))
        assert torch.equal(layer.weight_scales, scales), step
        if dense_8bit:
            ref = Moments8((33, 300), torch.device("cpu"))
            ref.write(slice(0, 33), m, v)
            assert all(torch.equal(a, b) for a, b in zip(opt.moments8["embed"].tensors(), ref.tensors())), step
            assert not opt.dense8 and opt.slots[0].m is None  # no bitsandbytes state, no 16-bit moments
        else:
            assert torch.equal(opt.slots[0].m, m) and torch.equal(opt.slots[0].v, v), step
    fresh = LowRankOptimizer([Slot(name="embed", param=layer.handle, index=1, projected=False)],
                             optimizer_settings(cfg))
    fresh.load_state_dict(opt.state_dict())  # a checkpoint carries the 8-bit moments
    if dense_8bit:
        assert all(torch.equal(a, b) for a, b in zip(fresh.moments8["embed"].tensors(), opt.moments8["embed"].tensors()))


def test_prepare_stores_embedding_and_head_in_int8_and_training_runs():
    """``prepare`` with ``embedding_dtype=int8`` (the memory-minimal setting: Mode B rank 1 with lm_head projected,
    INT8 projected weights, 8-bit dense moments): the embedding and the head are INT8 (1 B per element + 4 B per
    block), the model's loss through the fused path equals the plain path's (BF16 logits; 2e-2 absolute on a loss
    of ~5.5: the plain path rounds the logits to BF16 before the fp32 softmax), and three steps lower the loss."""
    model = tiny_llama(dtype=torch.bfloat16)
    cfg = hmt.Config(mode="B", basis="random", scaling="tensor", rank=1, scale=128, state_dtype="bf16",
                     target_patterns=("attn", "mlp", "lm_head"), dense_8bit=True, weight_dtype="int8",
                     embedding_dtype="int8", lr=1e-2)
    method = hmt.make(cfg)
    method.prepare(model)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, Int8Embedding) and type(head) is Int8Linear
    assert emb.weight_codes.dtype == head.weight_codes.dtype == torch.int8
    method.attach(model, max_grad_norm=None)
    ids = batches(1)[0]
    with torch.no_grad():
        plain = float(model(input_ids=ids, labels=ids).loss)
        fused = float(fused_ce.causal_lm_loss(model, ids, chunk_tokens=8))
    assert abs(plain - fused) <= 2e-2, (plain, fused)
    losses = []
    for _ in range(3):
        loss = fused_ce.causal_lm_loss(model, ids, chunk_tokens=8)
        loss.backward()
        method.step()
        method.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    summary = method.summary()
    assert "model.embed_tokens.weight" in method.opt.moments8
    expected = sum(m.weight_codes.numel() + 4 * m.weight_scales.numel() for m in (emb, head))
    assert summary["int8/weight_bytes"] >= expected


def _int8_embedding_run(max_grad_norm: float | None, steps: int = 3):
    """``steps`` training steps of the memory-minimal setting (INT8 embedding and head, 8-bit dense moments) from
    the same model, data and seed → (losses, the model, the method)."""
    model = tiny_llama(dtype=torch.bfloat16)
    cfg = hmt.Config(mode="B", basis="random", scaling="tensor", rank=1, scale=128, state_dtype="bf16",
                     target_patterns=("attn", "mlp"), dense_8bit=True, embedding_dtype="int8", lr=1e-2, seed=3)
    method = hmt.make(cfg)
    method.prepare(model)
    method.attach(model, max_grad_norm=max_grad_norm)
    losses = []
    for x in batches(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        method.step()
        method.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model, method


def test_a_deferred_int8_embedding_update_keeps_its_8bit_moments():
    """With clipping the per-layer engine defers the dense updates to ``finish_step`` and runs them grouped
    (``hmt_core.optim.grouped.update_dense_many``); the INT8 embedding and head still step with their 8-bit moments
    (``Moments8``, uint8 codes; no 16-bit moments on the slot), never the grouped one-tensor AdamW. A threshold that
    never clips (coefficient exactly 1) gives the unclipped run's trajectory bit for bit: losses and final weights."""
    losses, model, method = _int8_embedding_run(max_grad_norm=1e9)
    ref_losses, ref_model, ref = _int8_embedding_run(max_grad_norm=None)
    states = {}
    for run, m in (("clipped", method), ("unclipped", ref)):
        for s in m.opt.slots:
            if s.name in ("model.embed_tokens.weight", "lm_head.weight"):
                eight = m.opt.moments8.get(s.name)
                states[run, s.name] = (None if s.m is None else str(s.m.dtype),  # 16-bit moments: none
                                       None if eight is None else sorted({str(t.dtype) for t in eight.tensors()}))
    sd, ref_sd = model.state_dict(), ref_model.state_dict()
    differ = {n: int((t != ref_sd[n]).sum()) for n, t in sd.items() if not torch.equal(t, ref_sd[n])}
    assert losses == ref_losses and not differ, (losses, ref_losses, differ, states)
    assert len(states) == 4 and all(s == (None, ["torch.float32", "torch.uint8"]) for s in states.values()), states


def test_bad_settings_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="method.embedding_dtype must be one of"):
        hmt.Config(embedding_dtype="fp8")
    with pytest.raises(ValueError, match="method.embedding_dtype=int8 writes its updates by stochastic rounding"):
        hmt.Config(embedding_dtype="int8", master_weights=True)
    model = tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    with pytest.raises(ValueError, match="input embedding and the LM head are tied"):
        hmt.make(hmt.Config(embedding_dtype="int8")).prepare(model)
    from hmt_core.optim.sharded import sharded_config_error

    # dist=fsdp2 keeps INT8 tables whole on every rank (tests/test_fsdp2_rows.py); 8-bit dense moments stay refused
    assert sharded_config_error(hmt.Config(embedding_dtype="int8")) is None
    assert "method.dense_8bit=True is not supported with sharded weights (dist=fsdp2)" in sharded_config_error(
        hmt.Config(embedding_dtype="int8", dense_8bit=True))


def test_dry_run_traces_the_int8_embedding_and_head_and_equals_a_real_run():
    """``mode=dryrun`` traces the memory-minimal step with the INT8 embedding and head (8-bit dense moments, the
    fused loss's block dequantizations) and its figures equal a real CPU run's within 1% (the fake/real criterion of
    tests/test_int8_weights.py); the meter's ``params`` drop by the vocabulary matrices' 2 B → 1 B + 4/256 B per
    element against the same run with BF16 embedding and head, and ``optimizer`` holds the 8-bit moments."""
    from test_int8_weights import _assert_fake_matches_real, _dry

    minimal = ["model=tiny", "model.num_layers=1", "model.vocab_size=1024", "train.seq_len=32",
               "train.batch_size=2", "method=hmt", "method.mode=B",
               "method.basis=random", "method.scaling=tensor", "method.rank=1", "method.scale=128",
               "method.target_patterns=[attn,mlp,lm_head]", "method.state_dtype=bf16", "method.dense_8bit=true",
               "activation=full_ckpt", "train.max_grad_norm=0", "method.weight_dtype=int8"]
    from test_dryrun_fidelity import _run

    real, fake = _dry(*minimal, "method.embedding_dtype=int8")
    _assert_fake_matches_real(real, fake)
    _, bf16 = _dry(*minimal)
    model = _run(*minimal).model
    vd, vb = model.vocab_size * model.hidden_size, model.vocab_size * -(-model.hidden_size // 256)
    int8_bytes = 2 * (vd + 4 * vb)  # embedding + head: codes + fp32 block scales
    got = fake["method_summary"]["int8/weight_bytes"] - bf16["method_summary"]["int8/weight_bytes"]
    assert got == int8_bytes, (got, int8_bytes)
    cats, base = fake["report"].peak_by_category_bytes, bf16["report"].peak_by_category_bytes
    # at the peak: 2·2·V·d BF16 bytes replaced by the codes and scales and two 2-byte phantoms
    assert base["params"] - cats["params"] == 4 * vd - int8_bytes - 4, (base["params"], cats["params"])
    # the embedding's 8-bit moments: 1 B per element and 4 B per block, each of m and v, in fake and real runs
    moments = 2 * (vd + 4 * vb) // 2
    for run in (real, fake):
        assert run["method_summary"]["optim/state_bytes"] >= moments, (run["method_summary"], moments)
