"""Resuming a multi-process run at another world size (``experiments.checkpoint.dcp``, DCP resharding), CPU, gloo.

The global batch is the same for every world size W (rank r takes rows [r·B/W, (r+1)·B/W)), so only the state's
layout depends on W. Three spawns (W = 1, 2, 1), each running every case: build, train 2 steps, write a DCP
checkpoint, train 2 more (the uninterrupted run); then restore the checkpoint written at the *other* world size into
a model built from other weights and train the same 2 steps.

1. Resharding is exact: the state restored at the new W, gathered to full tensors (weights, AdamW moments, hmt's
   bases and moments), equals bit for bit the state gathered at the writer's W when it saved.
2. adamw under FSDP2 and DDP, 2 → 1 and 1 → 2: the resumed run equals the uninterrupted one **bit for bit** when
   W = 1 feeds the two halves as two micro-batches: every per-row operation is then the same computation on the
   same shapes as on the rank that owns the half, and the gradient's 2-term mean rounds identically either way
   (``fl(a/2 + b/2) == fl(a + b)/2``, ``tests/test_distributed.py``). Clipping is on for DDP (replicated
   gradients: the same norm), off under FSDP2 (a sharded norm is a different summation order).
3. hmt (per-layer Mode A) under FSDP2 (no grad accumulation there, so W = 1 steps on the whole batch) and DDP
   (likewise: per-layer Mode A projects each micro-batch, another computation than one all-reduced gradient),
   2 → 1 and 1 → 2: equal within ATOL (below). The only difference from the uninterrupted run is the summation
   order of each gradient: one 4-row backward instead of two 2-row ones plus the all-reduce / reduce-scatter, and
   the clipping norm's order. The weight gradient G = Σ_t x_t δ_tᵀ over T = 64 tokens: |δG| ≤ γ_T Σ_t |x_t δ_tᵀ|,
   γ_T ≈ T·u = 3.8e-6 (u = 2⁻²⁴), relative to the sum of magnitudes; it reaches the weights through Adam's
   direction D = m̂/(√v̂ + ε), homogeneous of degree 0 in the gradient, |δD| ≲ 2δ|D| with |D| ≤ 1 over 4 steps,
   and through the projection back (≤ α·√r·|δD|), so per step |δw| ≤ lr·α·√r·2γ_T ≈ 1e-2·0.25·√8·7.6e-6 ≈ 5.4e-8
   for projected weights (hmt's defaults lr = 1e-2, α = 0.25; r = 8) and ≤ lr·2γ_T ≈ 7.6e-8 for dense ones, plus
   one ulp of the stored weight (1.2e-7 for |w| < 2). Two steps: ≲ 4e-7; ATOL = 2e-6 (5× margin). Where a
   gradient entry is a near-cancelling sum, δ is relative to Σ|terms|, not to the entry, so Adam's sign-like first
   steps can move such an entry by more: the measured maximum is printed (``-s``) and asserted below ATOL.
   Measured over weights and moments: ≤ 1.2e-7 both ways (one ulp of a norm weight). No basis refresh falls in
   the resumed steps (``update_interval=8``): a refresh takes a randomized SVD of the gradient, whose singular
   vectors move by δ/gap, far more than the weights (with a refresh at step 3 the same comparison measured 5e-6
   and 3e-5; the uninterrupted W=1 and W=2 runs differ by 2e-5 from the step-0 refresh alone, printed for
   context).
   galore-torch and apollo-torch under FSDP2 (their state gathered to full values in the checkpoint,
   ``experiments.checkpoint.dtensor_state``), 2 → 1 and 1 → 2, W = 1 feeding the halves as micro-batches: the restored state
   equals the saved one bit for bit; the continued run differs only where DTensor sums partial products of the
   two shards (a left-projected Pᵀ G, APOLLO's channel and tensor norms), the reorderings bounded in
   ``tests/test_fsdp2_baselines.py`` (≲ 3.5e-7 per step, two steps here, and the reordered Adam moments carry it
   into the second): within ATOL_HMT as well (measured over weights and moments ≤ 8.8e-7 for galore, ≤ 7.4e-7 for
   APOLLO, whose norm-growth limiter's previous norm ≈ 107 is compared relatively: see ``_max_diff``). No
   projection refresh falls in the resumed steps (``update_proj_gap=8``).
4. End to end: ``torchrun --nproc_per_node 1`` resumes a 2-rank FSDP2 adamw checkpoint (W = 1 steps on the whole
   batch) and ends within ATOL_E2E of the uninterrupted 2-rank run (measured 1.2e-7 on weights, 9.3e-8 on moments).
5. A checkpoint whose state is per rank (``PER_RANK_STATE``) is refused at another world size with one line naming
   both sizes (checked with a stand-in entry: every supported combination reshards today).
6. On preemption every rank checkpoints but only rank 0 asks Slurm to requeue (one request per multi-task job).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import free_port  # noqa: E402

STEPS, SAVE_AT = 4, 2
ATOL_HMT = 2e-6
CASES = {  # name -> (dist mode, method overrides, max_grad_norm, W=1 feeds the halves as micro-batches)
    "fsdp2-adamw": ("fsdp2", {"name": "adamw"}, None, True),
    "ddp-adamw": ("ddp", {"name": "adamw"}, 1.0, True),
    "fsdp2-hmt": ("fsdp2", {"name": "hmt", "rank": 8, "update_interval": 8}, 1.0, False),  # refresh at step 0
    "ddp-hmt": ("ddp", {"name": "hmt", "rank": 8, "update_interval": 8}, 1.0, False),  # hmt's own all-reduce
    "fsdp2-galore": ("fsdp2", {"name": "galore", "rank": 8, "update_proj_gap": 8}, None, True),  # SVD at step 0
    "fsdp2-apollo": ("fsdp2", {"name": "apollo", "rank": 8, "update_proj_gap": 8}, None, True),
}


def _full_state(model, method) -> dict[str, object]:
    """Every checkpointed tensor, gathered to its global shape, by a flat key (collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    from torch.distributed.tensor import DTensor

    from experiments.checkpoint import dtensor_state
    from experiments.checkpoint.dcp import torch_optimizer
    from hmt_core.optim import sharded_state

    full = StateDictOptions(full_state_dict=True)
    out = {"model": get_model_state_dict(model, options=full)}
    opt = torch_optimizer(method)
    if opt is not None:
        out["optim"] = get_optimizer_state_dict(model, opt, options=full)
    elif type(getattr(method, "engine", None)).__name__ == "ShardedEngine":
        out["method"], rows = sharded_state.split_state(method.state_dict(), method.opt.slots)
        out["rows"] = {k: v.full_tensor() for k, v in rows.items()}
    elif any(isinstance(p, DTensor) for p in model.parameters()):  # galore-torch/apollo-torch on FSDP2 shards
        out["method"] = dtensor_state.to_full(method.state_dict())
    else:
        out["method"] = method.state_dict()
    return _flatten(out)


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _flatten(sub, f"{prefix}{key}/").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, sub in enumerate(value) for k, v in _flatten(sub, f"{prefix}{i}/").items()}
    if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):  # galore/apollo projector objects
        return _flatten(vars(value), f"{prefix}{type(value).__name__}/")
    return {prefix.rstrip("/"): value.detach().clone() if isinstance(value, torch.Tensor) else value}


def _max_diff(a: dict, b: dict) -> tuple[float, list[str]]:
    """(max over tensors of max|a − b| / max(1, max|b|), keys that differ in presence, type, shape or non-tensor
    value): an absolute difference for weights and moments (|b| < 1 here), a relative one for state of larger
    magnitude (APOLLO's norm-growth limiter keeps the previous update norm, ~100, which a sharded norm sums in
    another order)."""
    worst, bad = 0.0, sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape:
            if x.numel():
                scale = max(1.0, float(y.double().abs().max()))
                worst = max(worst, float((x.double() - y.double()).abs().max()) / scale)
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
            bad.append(k)
    return worst, bad


def _case(ctx, name: str, data, out: Path, seed: int):
    from experiments import methods
    from experiments.dist import parallel as distributed
    from experiments.checkpoint.dcp import DistCheckpointer
    from experiments.loop import train_step
    from helpers import tiny_llama

    mode, overrides, clip, halves = CASES[name]
    model = distributed.shard_model(tiny_llama(seed=seed), ctx)
    method = methods.make_method(methods.make_config(overrides))
    method.attach(model, max_grad_norm=clip)
    method.set_lr_scale(1.0)
    forward = distributed.wrap_for_forward(model, method, ctx)
    ckpt = DistCheckpointer(out / f"ckpt-{name}-w{ctx.world_size}", every=1, keep=1, model=model, method=method,
                            meta={}, ctx=ctx)
    rows = data[0].shape[0] // ctx.world_size

    def step(x: torch.Tensor) -> None:
        if ctx.world_size == 1 and halves:
            micro = list(x.split(x.shape[0] // 2))
        else:
            micro = [x[ctx.rank * rows:(ctx.rank + 1) * rows]]
        train_step(forward, method, micro, meter=None, autocast=contextlib.nullcontext, skip_nonfinite=True)

    return model, method, ckpt, step


def _worker(rank: int, world: int, port: int, out: str, other: int | None) -> None:
    """Uninterrupted runs at ``world`` (saving at SAVE_AT); then, when ``other`` is given, resume the checkpoints
    written at ``other`` ranks and compare with what that world size saved and reached."""
    import torch.distributed as dist

    from experiments.checkpoint.manager import LoopState, ResumePoint
    from experiments.dist.parallel import DistContext
    from experiments.checkpoint import store as ck

    from helpers import join_gloo

    join_gloo(rank, world, port)
    root = Path(out)
    try:
        gen = torch.Generator().manual_seed(7)
        data = [torch.randint(0, 256, (4, 16), generator=gen) for _ in range(STEPS)]
        results = {}
        for name, (mode, *_rest) in CASES.items():
            ctx = DistContext(mode=mode, rank=rank, world_size=world, local_rank=rank, backend="gloo",
                              device=torch.device("cpu"))
            if other is None or not (root / f"{name}-w{world}-final.pt").exists():
                model, method, ckpt, step = _case(ctx, name, data, root, seed=0)
                for x in data[:SAVE_AT]:
                    step(x)
                ckpt.save(LoopState(next_step=SAVE_AT))
                saved = _full_state(model, method)
                for x in data[SAVE_AT:]:
                    step(x)
                final = _full_state(model, method)
                if rank == 0:
                    torch.save({"saved": saved, "final": final}, root / f"{name}-w{world}-final.pt")
            if other is None or not (root / f"ckpt-{name}-w{other}").exists():
                continue
            model, method, ckpt, step = _case(ctx, name, data, root, seed=1)
            point = next(p for _, p in ck.list_checkpoints(root / f"ckpt-{name}-w{other}"))
            ckpt.check_resume(ResumePoint(point, ck.verify(point), []))
            state = ckpt.restore(ResumePoint(point, ck.verify(point), []), torch.device("cpu"))
            restored = _full_state(model, method)
            for x in data[state.next_step:]:
                step(x)
            final = _full_state(model, method)
            ref = torch.load(root / f"{name}-w{other}-final.pt", weights_only=False)
            (d_restored, bad_restored), (d_final, bad_final) = _max_diff(restored, ref["saved"]), \
                _max_diff(final, ref["final"])
            results[f"{name} {other}->{world}"] = {"restored": d_restored, "restored_bad": bad_restored,
                                                  "final": d_final, "final_bad": bad_final}
        Path(out, f"w{world}-rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _spawn(out: Path, world: int, other: int | None) -> dict:
    from helpers import spawn_gloo

    spawn_gloo(_worker, (world, free_port(), str(out), other), nprocs=world)
    merged: dict = {}
    for rank in range(world):
        for key, value in json.loads((out / f"w{world}-rank{rank}.json").read_text()).items():
            merged[f"{key} (rank {rank})"] = value
    return merged


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dist_resume")
    _spawn(out, 1, None)  # W=1: uninterrupted runs and their checkpoints
    results = _spawn(out, 2, 1)  # W=2: its own runs, then resume W=1's checkpoints
    results.update(_spawn(out, 1, 2))  # W=1 again: resume W=2's checkpoints
    for name in CASES:  # context: the same runs, uninterrupted, at W=1 and W=2
        a, b = (torch.load(out / f"{name}-w{w}-final.pt", weights_only=False)["final"] for w in (1, 2))
        print(f"{name} uninterrupted, W=1 vs W=2: max|a-b| {_max_diff(a, b)[0]:.3e}")
    for key, r in sorted(results.items()):
        print(f"{key}: restored state max|a-b| {r['restored']:.3e}, after {STEPS - SAVE_AT} more steps "
              f"max|a-b| {r['final']:.3e}")
    return results


@pytest.mark.parametrize("case", ["fsdp2-adamw 2->1", "fsdp2-adamw 1->2", "ddp-adamw 2->1", "ddp-adamw 1->2",
                                  "fsdp2-hmt 2->1", "fsdp2-hmt 1->2", "ddp-hmt 2->1", "ddp-hmt 1->2",
                                  "fsdp2-galore 2->1", "fsdp2-galore 1->2", "fsdp2-apollo 2->1", "fsdp2-apollo 1->2"])
def test_a_checkpoint_resumes_at_another_world_size(resumed, case):
    rows = {k: v for k, v in resumed.items() if k.startswith(case + " ")}
    assert rows, f"{case}: not run ({sorted(resumed)})"
    tolerance = 0.0 if "-adamw " in case else ATOL_HMT
    for key, r in rows.items():
        assert not r["restored_bad"] and not r["final_bad"], f"{key}: keys differ {r}"
        assert r["restored"] == 0.0, f"{key}: the resharded state differs from the saved one by {r['restored']:.3e}"
        assert r["final"] <= tolerance, f"{key}: max|a-b| {r['final']:.3e} > {tolerance:.1e} after resuming"


def test_per_rank_state_is_refused_at_another_world_size(monkeypatch, tmp_path):
    from experiments.checkpoint import dcp as dist_checkpoint
    from experiments.checkpoint.manager import ResumePoint
    from experiments.errors import UserError

    class Stub(dist_checkpoint.DistCheckpointer):
        def __init__(self, world: int) -> None:  # no process group: check_resume reads only the manifest
            self.ctx = type("Ctx", (), {"mode": "fsdp2", "world_size": world})()
            self.method = type("M", (), {"name": "hmt"})()

    monkeypatch.setitem(dist_checkpoint.PER_RANK_STATE, ("fsdp2", "hmt"), "its moments are per-rank tensors")
    point = ResumePoint(tmp_path / "step-00000002", {"step": 2, "meta": {"dist": {"world_size": 2}}}, [])
    Stub(2).check_resume(point)  # the same world size: fine
    with pytest.raises(UserError) as e:
        Stub(1).check_resume(point)
    message = str(e.value)
    assert "\n" not in message and "written by 2 ranks but this run has 1" in message, message
    assert "its moments are per-rank tensors" in message and "resume with 2 ranks" in message, message


# ------------------------------------------------------------------------------------ end to end with torchrun
E2E = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.intermediate_size=128",
       "model.dtype=fp32", "train.autocast=false", "train.seq_len=32", "train.batch_size=4", "train.steps=4",
       "train.warmup_steps=0", "train.eval_every=2", "train.eval_batches=1", "train.progress=false",
       "train.checkpoint_every=2", "train.keep_checkpoints=0", "method=adamw", "device=cpu", "dist=fsdp2"]
ATOL_E2E = 2e-6  # W=1 steps on the whole batch here: the summation-order bound of item 3 (adamw: no projection)


def _torchrun(nproc: int, results: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", "experiments.run", f"results_dir={results}", *E2E, *overrides]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)


def _dcp_tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint: weights, AdamW's moments, and (galore, apollo) the gathered state entry."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from experiments.checkpoint import dtensor_state

    dcp_to_torch_save(str(path), str(tmp))
    state = torch.load(tmp, weights_only=False)
    out = {"model": state["model"], "optim": state.get("optim")}
    if "method" in state:
        state["method"].seek(0)
        blob = torch.load(state["method"], weights_only=False)
        out["method"] = dtensor_state.full_values(blob)
    return {k: v for k, v in _flatten(out).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("method", ["adamw", "galore"])
def test_torchrun_fsdp2_checkpoint_of_two_ranks_resumes_on_one(tmp_path, method):
    """``torchrun --nproc_per_node 1`` resumes a 2-rank FSDP2 checkpoint (``train.resume=<step dir>``) and ends where
    the uninterrupted 2-rank run ends, within ATOL_E2E (weights and optimizer state; galore-torch's gathered state,
    no projection refresh after step 0 so that its SVD does not amplify the summation order)."""
    results = tmp_path / "results"
    extra = [f"method={method}"] + (["method.rank=8", "method.update_proj_gap=100"] if method == "galore" else [])
    full = _torchrun(2, results, "run_id=w2", *extra)
    assert full.returncode == 0, full.stderr
    step2 = results / "w2" / "checkpoints" / "step-00000002"
    resumed = _torchrun(1, results, "run_id=w1", f"train.resume={step2}", *extra)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming w1 at step 2 from {step2}" in resumed.stderr, resumed.stderr
    a, b = (json.loads((results / r / "summary.json").read_text()) for r in ("w2", "w1"))
    assert (a["dist"]["world_size"], b["dist"]["world_size"]) == (2, 1)
    x = _dcp_tensors(results / "w2" / "checkpoints" / "step-00000004", tmp_path / "a.pt")
    y = _dcp_tensors(results / "w1" / "checkpoints" / "step-00000004", tmp_path / "b.pt")
    worst, bad = _max_diff(x, y)
    state_prefix = "optim/" if method == "adamw" else "method/"  # the optimizer state is compared too
    assert any(k.startswith(state_prefix) for k in x) and x.keys() == y.keys(), sorted(set(x) ^ set(y))
    print(f"torchrun fsdp2 {method} 2 -> 1: max|a-b| {worst:.3e} over {len(x)} tensors; train loss "
          f"{a['train_loss']!r} vs {b['train_loss']!r}, val loss {a['val_loss']!r} vs {b['val_loss']!r}")
    assert not bad and worst <= ATOL_E2E, (worst, bad)
    assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * abs(a["val_loss"])


def test_only_rank_zero_requests_the_slurm_requeue(monkeypatch, tmp_path):
    import signal

    from experiments.checkpoint import manager as checkpointing
    from experiments.checkpoint import dcp as dist_checkpoint
    from experiments.checkpoint.manager import LoopState, Preempted

    requests: list[int] = []
    monkeypatch.setattr(checkpointing, "request_slurm_requeue", lambda: requests.append(1) or "requeued")

    class Stub(dist_checkpoint.DistCheckpointer):
        def __init__(self, rank: int) -> None:  # no process group: save is stubbed
            self.ctx = type("Ctx", (), {"is_main": rank == 0, "rank": rank})()
            self.signal_received = signal.SIGTERM

        def save(self, state):
            return type("Saved", (), {"path": tmp_path / "step-00000003"})()

    for rank, expected in ((1, 0), (0, 1)):
        with pytest.raises(Preempted) as e:
            Stub(rank).preempt(LoopState(next_step=3))
        assert len(requests) == expected and "step-00000003" in str(e.value), (rank, requests, str(e.value))
