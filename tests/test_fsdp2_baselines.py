"""galore-torch and apollo-torch under FSDP2 (``dist=fsdp2``), on CPU with gloo, two processes.

Their optimizers step FSDP2's DTensor shards unchanged (``experiments.checkpoint.dtensor_state`` says how); these tests check
that this is the single-process method, and what it communicates:

1. One step at a time from the same state, fsdp2 + galore / apollo / APOLLO-Mini equals the single-process
   optimizer on the same global batch, over 4 steps with ``update_proj_gap=2`` (projections refreshed at steps 0
   and 2, moments carried across): each step starts the reference from the sharded run's own state gathered to
   full tensors (weights, moments, projector matrices), steps it on the whole batch and compares the weights.
2. Every state tensor a right-projected weight (rows ≥ cols) keeps is a row shard: a rank holds 1/W of the
   single-process bytes; left-projected moments (r × n) are replicated.
3. The gradient is gathered only where the method factors it: galore-torch's SVD at refresh steps (one all-gather
   per projected weight), never between refreshes, never for APOLLO's seeded random bases (DTensor's
   ``CommDebugMode`` counts the collectives of each optimizer step).
4. The harness's byte counter (``experiments.dist.comm``) counts under FSDP2 exactly the payloads the collectives'
   shapes give: FSDP2's weight all-gathers, its gradient reduce-scatters, and galore's extra traffic.

Tolerance. Everything is fp32 and clipping is off (a sharded norm is another summation order). FSDP2's
reduce-scatter mean of 2 terms rounds like the reference's autograd sum of halves (``tests/test_distributed.py``),
a refresh factors the gathered gradient, equal to the reference's, and every right-projected or element-wise
operation is the same arithmetic on a subset of the rows. What is reordered: (a) a left-projected Ĝ = Pᵀ G is a sum
of two partial products (|δĜ_jk| ≤ γ_m Σ_i |P_ij G_ik|, γ_m ≈ m·u = 3.8e-6 for m = 64, u = 2⁻²⁴) and (b) APOLLO's
norms of a row-sharded tensor (channel norms across rows, the tensor norm, the norm-growth limiter's ‖·‖) are
sums of two partial sums of squares (relative δ ≤ γ_n ≲ 1.1e-5 for n ≤ 176 terms); (c) a GEMM on half the rows
may block its K-loop differently. A relative δ of Adam's input moves its direction D = m̂/(√v̂ + ε) by ≲ 2δ|D|,
|D| ≤ 1 on these first steps; the weight then moves by ≤ lr·α·√r·2δ (GaLore: lr 1e-2, α 0.25, r 8: ≤ 6e-8) or, for
APOLLO's scaled full-rank gradient, by ≤ lr·|s·G|·2δ with |s·G| ≲ 1 after the limiter (≤ 2.2e-7), plus one ulp of
the stored weight (≤ 1.2e-7 for |w| < 2). Bound ≈ 3.5e-7; ATOL = 2e-6 (5× margin). The measured maxima are printed
(``-s``) and on failure.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_distributed import spawn_pair  # noqa: E402

STEPS = 4  # refreshes at steps 0 and 2
ATOL = 2e-6  # see the module docstring
CASES = {
    "galore": {"name": "galore", "rank": 8, "update_proj_gap": 2},
    "apollo": {"name": "apollo", "rank": 8, "update_proj_gap": 2},
    "apollo-mini": {"name": "apollo", "variant": "mini", "update_proj_gap": 2},
}
RIGHT, LEFT = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"


def _build(overrides: dict, model):
    from experiments import methods

    method = methods.make_method(methods.make_config(dict(overrides)))
    method.attach(model, max_grad_norm=None)
    method.set_lr_scale(1.0)
    return method


def _state_bytes(method, model, name: str, *, local: bool, everything: bool = False) -> int:
    """Bytes of the optimizer-state matrices of parameter ``name`` (a DTensor's local shard when ``local``, its full
    value otherwise); ``everything``: also the projector objects' matrices (galore-torch's ``ortho_matrix``) and
    scalar tensors (APOLLO's previous update norm)."""
    from torch.distributed.tensor import DTensor

    param = dict(model.named_parameters())[name]
    state = method.driver.optimizer.state[param]
    values = [v for value in state.values() for v in ([value] if isinstance(value, torch.Tensor) else
                                                      list(getattr(value, "__dict__", {}).values()) if everything
                                                      else [])]
    total = 0
    for value in values:
        if isinstance(value, DTensor):
            value = value._local_tensor if local else value.full_tensor()
        if isinstance(value, torch.Tensor) and (everything or value.dim() > 0):
            total += value.numel() * value.element_size()
    return total


def _case(ctx, overrides: dict, data) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor.debug import CommDebugMode

    from experiments.dist import parallel as distributed
    from experiments.checkpoint import dtensor_state
    from experiments.loop import lm_loss
    from helpers import tiny_llama

    full = StateDictOptions(full_state_dict=True)
    model = distributed.shard_model(tiny_llama(seed=0), ctx)
    method = _build(overrides, model)
    rows = data[0].shape[0] // ctx.world_size
    out = {"diff": [], "gathers": [], "reduces": []}
    for x in data:
        weights = get_model_state_dict(model, options=full)
        state = dtensor_state.to_full(method.state_dict())
        reference = tiny_llama(seed=1)
        reference.load_state_dict(weights)
        ref = _build(overrides, reference)
        ref.load_state_dict(copy.deepcopy(state))
        ((lm_loss(reference, x[:rows]) + lm_loss(reference, x[rows:])) / 2).backward()
        ref.step()

        lm_loss(model, x[ctx.rank * rows:(ctx.rank + 1) * rows]).backward()
        with CommDebugMode() as comm:
            method.step()
        method.zero_grad()
        counts = {str(op): n for op, n in comm.get_comm_counts().items()}
        out["gathers"].append(sum(n for op, n in counts.items() if "all_gather" in op))
        out["reduces"].append(sum(n for op, n in counts.items() if "all_reduce" in op))
        after, expected = get_model_state_dict(model, options=full), reference.state_dict()
        out["diff"].append({k: float((after[k].double() - v.double()).abs().max()) for k, v in expected.items()})
        if len(out["diff"]) == 2:  # the state after a step: what the summary reports is this rank's share
            local = sum(_state_bytes(method, model, n, local=True, everything=True) for n, _ in model.named_parameters())
            out["summary_bytes"] = (method.summary()["optim/state_bytes"], local, ref.summary()["optim/state_bytes"])
        if len(out["diff"]) == 1:
            out["bytes"] = {kind: (_state_bytes(method, model, name, local=True),
                                   _state_bytes(method, model, name, local=False))
                            for kind, name in (("right", RIGHT), ("left", LEFT))}
    return out


def _comm_case(ctx, overrides: dict, data) -> dict:
    """Bytes counted per training step (``experiments.dist.comm.CommCounter``: FSDP2's all-gathers as ``param``,
    its reduce-scatters and DTensor's collectives as ``grad``) and the shapes they should equal."""
    from experiments.dist import parallel as distributed
    from experiments.dist.comm import CommCounter
    from experiments.loop import lm_loss
    from helpers import tiny_llama

    counter = CommCounter().install()
    try:
        model = distributed.shard_model(tiny_llama(seed=0), ctx)
        method = _build(overrides, model)
        rows = data[0].shape[0] // ctx.world_size
        steps = []
        for x in data[:2]:
            before = counter.snapshot()
            lm_loss(model, x[ctx.rank * rows:(ctx.rank + 1) * rows]).backward()
            method.step()
            method.zero_grad()
            steps.append({k: v - before.get(k, 0) for k, v in counter.snapshot().items()})
    finally:
        counter.uninstall()
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {"steps": steps, "shapes": full}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from experiments.dist.parallel import DistContext
    from helpers import join_gloo, seeded_token_batches

    join_gloo(rank, world, port)
    try:
        ctx = DistContext(mode="fsdp2", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                          device=torch.device("cpu"))
        data = seeded_token_batches(STEPS)
        results = {name: _case(ctx, overrides, data) for name, overrides in CASES.items()}
        results["comm"] = {name: _comm_case(ctx, overrides, data)
                           for name, overrides in (("adamw", {"name": "adamw"}), ("galore", CASES["galore"]))}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("fsdp2_baselines"))


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_step_equals_the_single_process_optimizer_on_the_global_batch(runs, case):
    for rank, results in runs.items():
        for step, diffs in enumerate(results[case]["diff"]):
            worst = max(diffs.values())
            top = sorted(diffs.items(), key=lambda kv: -kv[1])[:4]
            print(f"{case} rank {rank} step {step}: max|a-b| {worst:.3e} ({', '.join(f'{k} {v:.1e}' for k, v in top)})")
            bad = {k: v for k, v in diffs.items() if v > ATOL}
            assert not bad, f"{case}, rank {rank}, step {step}: weights differ by more than {ATOL:.0e}: {bad}"


@pytest.mark.parametrize("case", CASES)
def test_right_projected_state_is_a_row_shard_and_left_projected_state_is_replicated(runs, case):
    for rank, results in runs.items():
        (right_local, right_full), (left_local, left_full) = results[case]["bytes"]["right"], \
            results[case]["bytes"]["left"]
        assert right_full > 0 and left_full > 0, results[case]["bytes"]
        assert 2 * right_local == right_full, f"{case} rank {rank}: right-projected state {right_local} of {right_full} B"
        assert left_local == left_full, f"{case} rank {rank}: left-projected state {left_local} of {left_full} B"


@pytest.mark.parametrize("case", CASES)
def test_the_summarys_optimizer_state_is_this_ranks_share(runs, case):
    for rank, results in runs.items():
        reported, local, single = results[case]["summary_bytes"]
        print(f"{case} rank {rank}: optim/state_bytes {reported:,} (local tensors {local:,}; one process {single:,})")
        assert reported == local < single, (reported, local, single)


@pytest.mark.parametrize("case", CASES)
def test_the_gradient_is_gathered_only_for_galores_svd_at_refresh_steps(runs, case):
    for rank, results in runs.items():
        gathers = results[case]["gathers"]
        print(f"{case} rank {rank}: all-gathers per step {gathers}, all-reduces per step {results[case]['reduces']}")
        if case == "galore":  # 2 layers × 7 projected weights, refreshed at steps 0 and 2
            assert gathers == [14, 0, 14, 0], gathers
        else:
            assert gathers == [0] * STEPS, gathers


def test_counted_bytes_per_step_under_fsdp2_are_the_collectives_shapes(runs):
    """FSDP2 all-gathers every weight in forward and every decoder layer's again in backward (the root —
    embeddings, final norm, lm_head — is not resharded after forward), and reduce-scatters each gradient once:
    fp32 payloads of the full shapes (tiny Llama's dims are even: no padding). Clipping's norm (computed even
    without a limit) all-reduces one fp32 per parameter. galore adds, at a refresh, the all-gather of every
    projected gradient for galore-torch's SVD, and on every step three all-reduces of each left-projected
    weight's r × n partial projection (DTensor resolves the ``Partial`` sum at each of its three uses)."""
    import math

    r = CASES["galore"]["rank"]
    for who, res in runs.items():
        comm = res["comm"]
        shapes = comm["adamw"]["shapes"]
        numel = {n: math.prod(s) for n, s in shapes.items()}
        layer = sum(v for n, v in numel.items() if ".layers." in n)
        root = sum(v for n, v in numel.items() if ".layers." not in n)
        projected = {n: s for n, s in shapes.items() if (".self_attn." in n or ".mlp." in n)}
        left = [s for s in projected.values() if s[0] < s[1]]
        want_param = 4 * (2 * layer + root)
        want_grad = 4 * sum(numel.values()) + 4 * len(shapes)
        gather = 4 * sum(math.prod(s) for s in projected.values())
        left_reduce = 3 * 4 * sum(r * s[1] for s in left)
        for step, counted in enumerate(comm["adamw"]["steps"]):
            print(f"rank {who} adamw step {step}: param {counted['param']:,} B (want {want_param:,}), "
                  f"grad {counted['grad']:,} B (want {want_grad:,})")
            assert counted["param"] == want_param and counted["grad"] == want_grad, counted
        for step, counted in enumerate(comm["galore"]["steps"]):
            want = want_grad + left_reduce + (gather if step == 0 else 0)
            print(f"rank {who} galore step {step}: param {counted['param']:,} B, grad {counted['grad']:,} B "
                  f"(want {want:,}: + {left_reduce:,} left-projected all-reduces"
                  + (f" + {gather:,} gathered for the SVD)" if step == 0 else ")"))
            assert counted["param"] == want_param and counted["grad"] == want, counted
