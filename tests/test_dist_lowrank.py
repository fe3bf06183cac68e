"""Low-rank gradient communication (``dist.lowrank_comm``) and the byte counter (``experiments.dist.comm``), on
CPU with gloo, 2 processes (one ``torch.multiprocessing.spawn`` for every case).

1. Equivalence, one step at a time from the same state (per-layer hmt Mode A, randomized-SVD bases, rank 8,
   refreshes at steps 0 and 2, no clipping): the projected gradient Ĝ each weight's update receives with
   ``lowrank_comm`` equals the one from the full all-reduce within the fp32 bound derived below; refresh steps
   (which all-reduce the full gradient either way) are bit-identical, weights included.
2. Exact case: ``sides=identity`` (Ĝ = I·G: every gradient lies in the basis and the projection is exact
   arithmetic), clipping on: weights and gradient norm bit-identical to the full all-reduce on every step.
3. Bytes: the counted gradient bytes of a non-refresh step equal Σ r·max(out, in)·4 over projected weights + the
   dense parameters' fp32 bytes, derived from shapes; a refresh step and DDP adamw (counting comm hook) count every
   parameter's bytes; at a 125m-width 2-layer model, lowrank_comm's non-refresh step is ≤ 1/8 of DDP adamw's.

Tolerance of 1 (derivation). With W = 2 ranks and local fp32 gradients G_0, G_1, the exact value is
X = Pᵀ(G_0 + G_1)/2 (left side; G Qᵀᵀ likewise with the inner dimension n = in). Full path: fl(G_0/2 + G_1/2)
(division by 2 exact, one rounding u = 2⁻²⁴ for the sum), then a matmul over inner dimension n, whose error is
≤ γ_n |P|ᵀ|·| (Higham, Accuracy and Stability, §3.5, for any summation order; γ_n = nu/(1−nu)). Low-rank path:
two matmuls with the same bound on |G_k|/2 each, then one rounded sum. Both are therefore within
γ_{n+1} · |P|ᵀ S / 2 of X, with S = |G_0| + |G_1|, and differ from each other by at most
2 γ_{n+1} |P|ᵀ S / 2, evaluated in float64 from the actual local gradients (taken with ``autograd.grad``, so no
update hook fires). The bound holds on any CPU and BLAS; the measured difference is printed beside it.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_distributed import spawn_pair  # noqa: E402

U = 2.0**-24  # fp32 unit roundoff


def _method(overrides: dict, model, clip: float | None):
    from experiments import methods

    cfg = methods.make_config(overrides)
    method = methods.make_method(cfg)
    method.attach(model, max_grad_norm=clip)
    method.set_lr_scale(1.0)
    return method


def _ctx(rank: int, world: int, **kw):
    from experiments.dist.parallel import DistContext

    return DistContext(mode="ddp", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                       device=torch.device("cpu"), **kw)


def _snapshot(model, method) -> dict:
    buf = io.BytesIO()
    torch.save(method.state_dict(), buf)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "method": buf.getvalue()}


def _restore(model, method, snap: dict) -> None:
    model.load_state_dict(snap["weights"])
    method.load_state_dict(torch.load(io.BytesIO(snap["method"]), weights_only=False))


def _step(forward, method, ctx, x) -> float:
    from experiments.loop import train_step

    rows = x.shape[0] // ctx.world_size
    _, norm = train_step(forward, method, [x[ctx.rank * rows:(ctx.rank + 1) * rows]], meter=None,
                         autocast=contextlib.nullcontext, skip_nonfinite=True)
    return float(norm)  # a device tensor (Method.step)


def _record_updates(opt) -> dict:
    """Ĝ handed to each Mode A update, by weight name (the seam both paths share)."""
    seen, original = {}, opt.update_low_rank

    def update_low_rank(s, low, coef=None):
        seen[s.name] = low.detach().clone()
        return original(s, low, coef)

    opt.update_low_rank = update_low_rank
    return seen


def _abs_sum_of_local_grads(model, slots, ctx, x) -> dict:
    """S = Σ_k |G_k| per projected weight (float64), from each rank's local gradient."""
    import torch.distributed as dist

    from experiments.loop import lm_loss

    rows = x.shape[0] // ctx.world_size
    params = [s.param for s in slots]
    grads = torch.autograd.grad(lm_loss(model, x[ctx.rank * rows:(ctx.rank + 1) * rows]), params)
    out = {}
    for s, g in zip(slots, grads):
        a = g.abs().double()
        dist.all_reduce(a, op=dist.ReduceOp.SUM)
        out[s.name] = a
    return out


def _bound(s, total_abs, world: int):  # -> like Ĝ: 2 γ_{n+1} |P|ᵀ S / W in float64
    from hmt_core import projection as proj

    b = s.basis
    n = b.left.shape[0] if b.left is not None else b.right.shape[1]
    gamma = (n + 1) * U / (1 - (n + 1) * U)
    absb = proj.Basis(b.left.abs().double() if b.left is not None else None,
                      b.right.abs().double() if b.right is not None else None)
    return 2 * gamma * proj.project(total_abs, absb) / world


def _equivalence(rank: int, world: int, data) -> list[dict]:
    from experiments.dist import parallel as distributed
    from helpers import tiny_llama

    ctx = _ctx(rank, world)
    model = tiny_llama()
    method = _method({"name": "hmt", "rank": 8, "update_interval": 2}, model, clip=None)
    forward = distributed.wrap_for_forward(model, method, ctx)
    opt, reducer = method.engine.opt, method.engine.reduce_grad
    seen = _record_updates(opt)
    projected = [s for s in opt.slots if s.projected]
    out = []
    for step, x in enumerate(data):
        refresh = step % 2 == 0
        before = _snapshot(model, method)
        reducer.lowrank = False
        seen.clear()
        _step(forward, method, ctx, x)
        full, full_w = dict(seen), {k: v.clone() for k, v in model.state_dict().items()}
        after = _snapshot(model, method)
        _restore(model, method, before)
        bounds = {} if refresh else {s.name: _bound(s, a, world) for s, a in
                                     zip(projected, _abs_sum_of_local_grads(model, projected, ctx, x).values())}
        reducer.lowrank = True
        seen.clear()
        _step(forward, method, ctx, x)
        rows = {}
        for name, g_full in full.items():
            diff = (seen[name].double() - g_full.double()).abs()
            bound = bounds.get(name)
            rows[name] = {"max_diff": diff.max().item(), "max_abs": g_full.abs().max().item(),
                          "violations": int((diff > bound).sum()) if bound is not None else int((diff > 0).sum()),
                          "max_diff_over_bound": (diff / bound.clamp_min(1e-300)).max().item()
                          if bound is not None else None}
        weights_equal = all(torch.equal(v, full_w[k]) for k, v in model.state_dict().items())
        out.append({"refresh": refresh, "rows": rows, "weights_equal": weights_equal, "updates": len(rows),
                    "projected": len(projected)})
        _restore(model, method, after)  # the trajectory continues from the full all-reduce's step
    return out


def _exact(rank: int, world: int, data) -> list[dict]:
    from experiments.dist import parallel as distributed
    from helpers import tiny_llama

    ctx = _ctx(rank, world)
    model = tiny_llama()
    method = _method({"name": "hmt", "sides": "identity", "update_interval": 100}, model, clip=1.0)
    forward = distributed.wrap_for_forward(model, method, ctx)
    reducer, out = method.engine.reduce_grad, []
    for x in data:
        before = _snapshot(model, method)
        reducer.lowrank = False
        norm_full = _step(forward, method, ctx, x)
        full_w = {k: v.clone() for k, v in model.state_dict().items()}
        after = _snapshot(model, method)
        _restore(model, method, before)
        reducer.lowrank = True
        norm_low = _step(forward, method, ctx, x)
        differing = [k for k, v in model.state_dict().items() if not torch.equal(v, full_w[k])]
        out.append({"differing": differing, "norm_full": norm_full, "norm_low": norm_low})
        _restore(model, method, after)
    return out


def expected_bytes(model, slots, rank: int, local_batches: list[torch.Tensor]) -> dict:
    """From shapes: every trainable parameter's fp32 bytes (DDP adamw: ``full``), and with lowrank_comm per step
    (step 0 refreshes every basis, step 1 does not): a projected weight's full gradient at the refresh, r·max(out,
    in)·4 after it (one-sided: Ĝ is (out, r) or (r, in)); the embedding's non-zero rows as a sparse tensor on every
    step — the tokens of this rank's batch but its last position (whose hidden state no label reads): int64 row
    indices + fp32 rows; the rest dense."""
    from experiments.dist.comm import row_sparse_names

    projected, sparse = {s.name for s in slots if s.projected}, row_sparse_names(model)
    full, steps = 0, [0] * len(local_batches)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        nbytes = p.numel() * 4
        full += nbytes
        for i, x in enumerate(local_batches):
            if name in sparse:
                rows = torch.unique(x[:, :-1]).numel()
                steps[i] += rows * 8 + rows * p.shape[1] * 4
            else:
                steps[i] += rank * max(p.shape) * 4 if name in projected and i > 0 else nbytes
    return {"full": full, "steps": steps}


def _bytes(rank: int, world: int, data, model_fn, hmt_rank: int) -> dict:
    from experiments.dist import parallel as distributed
    from experiments.dist.comm import CommCounter

    counter = CommCounter().install()
    try:
        ctx = _ctx(rank, world, lowrank_comm=True, comm=counter)
        model = model_fn()
        method = _method({"name": "hmt", "rank": hmt_rank, "update_interval": 100}, model, clip=1.0)
        forward = distributed.wrap_for_forward(model, method, ctx)
        per_step, control = [], []
        for x in data[:2]:  # step 0 refreshes every basis, step 1 does not
            g0, c0 = counter.bytes["grad"], counter.bytes["control"]
            _step(forward, method, ctx, x)
            per_step.append(counter.bytes["grad"] - g0)
            control.append(counter.bytes["control"] - c0)
        rows = data[0].shape[0] // world
        expected = expected_bytes(model, method.engine.opt.slots, hmt_rank,
                                  [x[rank * rows:(rank + 1) * rows] for x in data[:2]])

        adamw_model = model_fn()
        adamw_ctx = _ctx(rank, world, comm=counter)
        adamw = _method({"name": "adamw"}, adamw_model, clip=1.0)
        adamw_forward = distributed.wrap_for_forward(adamw_model, adamw, adamw_ctx)
        g0 = counter.bytes["grad"]
        _step(adamw_forward, adamw, adamw_ctx, data[0])
        adamw_bytes = counter.bytes["grad"] - g0
        adamw_expected = sum(p.numel() * 4 for p in adamw_model.parameters() if p.requires_grad)
    finally:
        counter.uninstall()
    return {"per_step": per_step, "control": control, "expected": expected, "adamw": adamw_bytes,
            "adamw_expected": adamw_expected}


def width_125m_2_layers(vocab: int = 256, layers: int = 2, device: str = "cpu"):
    """The 125m phase's width (hidden 768, 12 heads, intermediate 2048) with 2 layers and a 256-token vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=12)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from helpers import tiny_llama

    from helpers import join_gloo

    join_gloo(rank, world, port)
    try:
        gen = torch.Generator().manual_seed(7)
        data = [torch.randint(0, 256, (4, 16), generator=gen) for _ in range(3)]
        results = {"equivalence": _equivalence(rank, world, data), "exact": _exact(rank, world, data[:2]),
                   "bytes_tiny": _bytes(rank, world, data, tiny_llama, 8),
                   "bytes_125m_width": _bytes(rank, world, data, width_125m_2_layers, 64)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("lowrank"))


def test_lowrank_comm_equals_the_full_all_reduce_within_the_fp32_bound(spawned):
    for rank, res in spawned.items():
        for step, row in enumerate(res["equivalence"]):
            table = "\n".join(f"  {k}: max|diff| {v['max_diff']:.3e}, max|Ĝ| {v['max_abs']:.3e}, "
                              f"max diff/bound {v['max_diff_over_bound']}, violations {v['violations']}"
                              for k, v in row["rows"].items())
            print(f"rank {rank} step {step} (refresh={row['refresh']}):\n{table}")
            assert row["updates"] == row["projected"] == 14, row  # 2 layers × 7 projected weights (attn, mlp)
            assert all(v["violations"] == 0 for v in row["rows"].values()), \
                f"rank {rank}, step {step}: Ĝ outside the fp32 summation bound:\n{table}"
            if row["refresh"]:  # the full gradient is all-reduced either way: the same computation
                assert row["weights_equal"], f"rank {rank}, step {step}: a refresh step differs"


def test_lowrank_comm_is_exact_when_every_gradient_lies_in_the_basis(spawned):
    for rank, res in spawned.items():
        for step, row in enumerate(res["exact"]):
            assert not row["differing"] and row["norm_full"] == row["norm_low"], (rank, step, row)


def test_counted_bytes_equal_the_shapes(spawned):
    for rank, res in spawned.items():
        for case in ("bytes_tiny", "bytes_125m_width"):
            b = res[case]
            print(f"rank {rank} {case}: counted per step {b['per_step']}, expected {b['expected']}, "
                  f"adamw {b['adamw']} (expected {b['adamw_expected']}), control {b['control']}")
            assert b["per_step"] == b["expected"]["steps"], b
            assert b["adamw"] == b["adamw_expected"] == b["expected"]["full"], b
            # no control collective in a step: a rank's non-finite loss reaches the others through the gradient
            # reduction (train_step's NaN backward seed), not through a per-micro-batch flag all-reduce
            assert b["control"] == [0, 0], b


def test_lowrank_comm_sends_at_most_an_eighth_of_ddp_adamw_at_125m_width(spawned):
    b = spawned[0]["bytes_125m_width"]
    ratio = b["per_step"][1] / b["adamw"]
    amortized = (b["per_step"][0] + 199 * b["per_step"][1]) / 200 / b["adamw"]  # refresh every 200 steps
    print(f"125m width, 2 layers, vocab 256, rank 64: lowrank_comm {b['per_step'][1] / 2**20:.2f} MiB/step vs "
          f"DDP adamw {b['adamw'] / 2**20:.2f} MiB/step: ratio {ratio:.4f} (amortized over "
          f"update_interval=200: {amortized:.4f})")
    assert ratio <= 1 / 8, ratio


# ------------------------------------------------------------------------------------------------ bad settings
from test_bad_inputs import assert_one_line_error, results  # noqa: E402,F401  (the fixture: an earlier run)
from test_distributed import TORCHRUN_2  # noqa: E402


@pytest.mark.parametrize("env, overrides, fragments", [
    ({}, ["dist.lowrank_comm=true"], ["dist.lowrank_comm=true needs dist=ddp"]),
    (TORCHRUN_2, ["dist=ddp", "dist.lowrank_comm=true", "method=adamw"], ["dist.lowrank_comm=true", "adamw"]),
    (TORCHRUN_2, ["dist=ddp", "dist.lowrank_comm=true", "method=hmt", "method.mode=B"], ["mode=B"]),
])
def test_lowrank_comm_outside_per_layer_hmt_mode_a_fails_with_one_line(capsys, monkeypatch, results, env,
                                                                        overrides, fragments):
    for key in TORCHRUN_2:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert_one_line_error(capsys, results, overrides, *fragments)
