"""``method.state_budget`` (hmt_core.rank_budget): the parser, the knapsack allocator against brute force, the
never-exceeded guarantee measured from the optimizer's state tensors (ordinary and per-layer steps, Mode A and B,
a dry run's shape-only tensors), the default against a real galore-torch optimizer, the runner, and a resume
from a checkpoint."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from helpers import batches, lm_step, tiny_llama
from test_bad_inputs import assert_one_line_error, results  # noqa: F401  (results: a pytest fixture)
from test_runner import run as run_runner
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig, LlamaForCausalLM

from baselines import galore
from experiments.checkpoint import store as ck
from hmt_core import hmt
from hmt_core.state_bytes import iter_state_tensors
from hmt_core.rank_budget import (GALORE_DEFAULT_RANK, LayerBudget, RankBudget, StateBudget, allocate, budget_bytes,
                                  galore_state_bytes, greedy_allocate, layer_state_bytes, parse_state_budget)


# ------------------------------------------------------------------------------------------------------ parser
@pytest.mark.parametrize("value,expected", [
    ("galore", StateBudget("galore", GALORE_DEFAULT_RANK)), ("GaLore", StateBudget("galore", GALORE_DEFAULT_RANK)),
    ("0.25", StateBudget("fraction", 0.25)), (0.25, StateBudget("fraction", 0.25)),
    ("1.0", StateBudget("fraction", 1.0)),
    ("2.5e-1", StateBudget("fraction", 0.25)), (".5", StateBudget("fraction", 0.5)),
    ("3GiB", StateBudget("bytes", 3 * 2**30)), ("500MB", StateBudget("bytes", 500 * 10**6)),
    ("1.5 KiB", StateBudget("bytes", 1536)), ("7b", StateBudget("bytes", 7)), ("2tib", StateBudget("bytes", 2 * 2**40)),
    (123456, StateBudget("bytes", 123456)), ("123456", StateBudget("bytes", 123456)),
    (None, None), ("null", None), ("None", None),
])
def test_parser_reads_fractions_bytes_and_galore(value, expected):
    assert parse_state_budget(value) == expected
    spelled = hmt.Config(state_budget=value).state_budget  # the Config keeps a string (as Hydra gives it) or None
    assert spelled is None if expected is None else parse_state_budget(spelled) == expected


@pytest.mark.parametrize("value", ["", "lots", "galore:128", "1.5", "0", "0.0", "-1", "-0.5", "1e9", "3 parsecs",
                                   "GiB", "nan", "inf", 0, -5, 0.0, 1.5, float("nan"), True, [1]])
def test_bad_budgets_name_the_key(value):
    with pytest.raises(ValueError, match=r"^method\.state_budget=") as err:
        hmt.Config(state_budget=value)
    assert "\n" not in str(err.value)


def test_hydra_spellings_reach_the_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from test_runner import CONF

    from experiments.config import to_run_config

    seen = {}
    for override in ("0.25", "3GiB", "123456", "null", "galore"):
        with initialize_config_dir(config_dir=CONF, version_base=None):
            cfg = compose("run", overrides=["method=hmt", f"method.state_budget={override}"])
        seen[override] = to_run_config(cfg).method.state_budget
    assert seen == {"0.25": "0.25", "3GiB": "3GiB", "123456": "123456", "null": None, "galore": "galore"}
    with initialize_config_dir(config_dir=CONF, version_base=None):
        assert to_run_config(compose("run", overrides=["method=hmt"])).method.state_budget == "galore"  # default


def test_cli_bad_or_infeasible_budget_is_one_line_error(capsys, results):  # noqa: F811  (the fixture)
    assert_one_line_error(capsys, results, ["method=hmt", "method.state_budget=lots"], "method.state_budget='lots'")
    # 1 KB cannot hold rank 1 of every projected weight: refused at attach, before anything is written
    assert_one_line_error(capsys, results, ["method=hmt", "method.state_budget=1KB"], "method.state_budget='1KB'",
                          "rank 1")


# ------------------------------------------------------------------------------------------------------ bytes
def test_galore_rank_is_the_baselines_default():
    assert GALORE_DEFAULT_RANK == galore.Config().rank


def test_budget_resolution():
    weights = [((688, 256), 2), ((256, 688), 2), ((256, 256), 4), ((32, 48), 2)]
    assert budget_bytes(StateBudget("bytes", 1000), weights) == 1000
    adamw = 2 * (688 * 256 * 2 * 2) + 256 * 256 * 2 * 4 + 32 * 48 * 2 * 2  # two moments in the weight's dtype
    assert budget_bytes(StateBudget("fraction", 0.5), weights) == adamw // 2
    # GaLore keeps (m, v) of the projected gradient + the projector, in the weight's dtype; rank ≤ min(out, in)
    assert budget_bytes(StateBudget("galore", 128), weights) == (
        2 * (2 * 688 * 128 + 128 * 256) * 2 + (2 * 256 * 128 + 128 * 256) * 4 + (2 * 32 * 48 + 32 * 32) * 2)
    assert layer_state_bytes((100, 30), 8, left=True, right=True, state_size=4, basis_size=2, extra=4) == \
        2 * 8 * 8 * 4 + (100 * 8 + 8 * 30) * 2 + 4


# --------------------------------------------------------------------------------------------------- allocator
def brute_force(values, costs, budget) -> float:
    feasible = (sum(v[j] for v, j in zip(values, pick)) for pick in itertools.product(*(range(len(c)) for c in costs))
                if sum(c[j] for c, j in zip(costs, pick)) <= budget)
    return max(feasible)


def total(values, costs, pick) -> tuple[float, int]:
    return sum(v[j] for v, j in zip(values, pick)), sum(c[j] for c, j in zip(costs, pick))


def random_instance(rng: random.Random, layers: int | None = None, concave: bool | None = None):
    values, costs = [], []
    for _ in range(layers or rng.randint(1, 5)):
        n = rng.randint(1, 5)
        c = sorted(rng.sample(range(1, 400), n))
        v = [rng.random() for _ in range(n)]
        if concave if concave is not None else rng.random() < 0.5:  # non-decreasing, as spectral energy is
            v.sort()
        values.append(v)
        costs.append(c)
    low, high = sum(min(c) for c in costs), sum(max(c) for c in costs)
    return values, costs, rng.randint(low, high)


def span(values) -> float:
    """The largest value step of any one layer: what rounding the LP's split layer can lose at most."""
    return max(max(v) - min(v) for v in values)


def test_allocator_is_feasible_and_within_one_layer_step_of_brute_force():
    """Feasible always (exact integer bytes); never further below the brute-force optimum than one layer's value
    span (the LP relaxation's bound, less the split layer rounded down). 1e-9 absorbs the LP's fp64 objective."""
    rng = random.Random(0)
    exact = 0
    for case in range(300):
        values, costs, budget = random_instance(rng)
        got, spent = total(values, costs, allocate(values, costs, budget))
        best = brute_force(values, costs, budget)
        assert spent <= budget, (case, values, costs, budget)
        assert got >= best - span(values) - 1e-9, (case, got, best, values, costs, budget)
        exact += got >= best - 1e-9
        g_value, g_spent = total(values, costs, greedy_allocate(values, costs, budget))
        assert g_spent <= budget, case
    print(f"allocate reached the brute-force optimum in {exact}/300 random instances")
    assert exact >= 240  # measured 280+: the rounding rarely matters (a regression bound, not a guarantee)


def test_allocator_is_exact_when_the_lp_vertex_is_integral():
    """Concave curves (value per byte falling along each layer's options) and a budget at a breakpoint of the
    greedy order: the LP optimum is integral, so ``allocate`` is the optimum itself (brute force, 1e-9: fp64)."""
    rng = random.Random(2)
    for case in range(100):
        values, costs, steps = [], [], []
        for layer in range(rng.randint(1, 5)):
            n = rng.randint(1, 5)
            dc = [rng.randint(1, 50) for _ in range(n - 1)]
            slopes = sorted((rng.random() for _ in range(n - 1)), reverse=True)
            c, v = [rng.randint(1, 20)], [rng.random()]
            for a, b in zip(dc, slopes):
                c.append(c[-1] + a)
                v.append(v[-1] + a * b)
                steps.append((b, a))
            values.append(v)
            costs.append(c)
        steps.sort(reverse=True)
        budget = sum(c[0] for c in costs) + sum(a for _, a in steps[:rng.randint(0, len(steps))])
        got, spent = total(values, costs, allocate(values, costs, budget))
        assert spent <= budget and got >= brute_force(values, costs, budget) - 1e-9, (case, values, costs, budget)


def energy_instance(rng: random.Random, layers: int):
    """Spectral-energy-like options: ranks 32..256 of (out, in) layers, E(r) = 1 − (1 − a)^√(r/32) (concave in
    r, as an energy curve is), capped at a random τ-rank; bytes linear in r."""
    values, costs = [], []
    for _ in range(layers):
        unit, a, top = rng.choice([640, 1536, 2560, 6016]), rng.uniform(0.2, 0.95), rng.randint(1, 4)
        grid = (32, 64, 128, 256)[:top]
        values.append([1 - (1 - a) ** (r / 32) ** 0.5 for r in grid])
        costs.append([unit * r for r in grid])
    return values, costs, rng.randint(sum(min(c) for c in costs), sum(max(c) for c in costs))


def exact_optimum(values, costs, budget) -> float:
    """The knapsack optimum by scipy.optimize.milp (HiGHS, relative gap 0; absolute gap 1e-6)."""
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    sizes = [len(v) for v in values]
    n = sum(sizes)
    one_hot = sparse.csr_matrix((np.ones(n), (np.repeat(np.arange(len(sizes)), sizes), np.arange(n))))
    res = milp(-np.concatenate(values), integrality=np.ones(n), bounds=Bounds(0, 1),
               constraints=[LinearConstraint(one_hot, 1, 1),
                            LinearConstraint(np.asarray(np.concatenate(costs), dtype=float)[None, :], -np.inf, budget)],
               options={"mip_rel_gap": 0.0})
    return -res.fun


def test_allocator_against_the_exact_milp_on_larger_instances():
    """60 layers of energy-like curves against the exact MILP (``exact_optimum``; 1e-6: HiGHS' absolute gap). The
    bound must hold; measured shortfall: mean 3e-4, max 1.1e-3 relative (printed)."""
    rng = random.Random(3)
    gaps = []
    for case in range(20):
        values, costs, budget = energy_instance(rng, 60)
        got, spent = total(values, costs, allocate(values, costs, budget))
        best = exact_optimum(values, costs, budget)
        assert spent <= budget and got >= best - span(values) - 1e-6, (case, got, best)
        gaps.append((best - got) / best)
    print(f"allocate vs exact MILP, 60 energy-like layers: mean shortfall {np.mean(gaps):.1e}, max {max(gaps):.1e}")
    assert max(gaps) < 1e-2  # measured 1.1e-3: a regression bound, not a guarantee


def test_allocator_edge_cases():
    # the LP takes A (0.61 for 6 bytes, the best ratio) and 4/5 of B's first step; rounded, B gets nothing and
    # 4 bytes stay unused: 0.61, while spending all 10 bytes on B gives 1.0 (within B's span of 1.0)
    values, costs = [[0.0, 0.61], [0.0, 0.5, 1.0]], [[0, 6], [0, 5, 10]]
    assert allocate(values, costs, 10) == [1, 0] == greedy_allocate(values, costs, 10)
    assert brute_force(values, costs, 10) == 1.0
    assert allocate([[0.1, 0.9], [0.2, 0.3]], [[1, 5], [1, 2]], 100) == [1, 1]  # not binding: each its best
    with pytest.raises(ValueError, match="cheapest"):
        allocate([[0.1], [0.2]], [[6], [5]], 10)


def test_rank_budget_never_exceeds_under_adversarial_refresh_orders():
    """Random layers, budgets, curves, τ-ranks and refresh orders (the predictions are as wrong as can be):
    after every refresh the ranks held fit the budget and no layer exceeds its τ-rank."""
    rng = random.Random(1)
    for case in range(40):
        grids = {f"l{i}": tuple(sorted(rng.sample([1, 2, 4, 8, 16, 32, 64], rng.randint(1, 4))))
                 for i in range(rng.randint(2, 7))}
        unit = {n: rng.randint(50, 500) for n in grids}
        layers = {n: LayerBudget(grid=g, costs=tuple(r * unit[n] for r in g), max_rank=64) for n, g in grids.items()}
        low, high = sum(x.costs[0] for x in layers.values()), sum(x.costs[-1] for x in layers.values())
        rb = RankBudget(rng.randint(low, high), layers)
        for step in range(0, 30, 5):
            order = list(grids)
            rng.shuffle(order)
            for n in order:
                grid = grids[n]
                tau = rng.choice(grid)
                curve = tuple(sorted(rng.random() for _ in grid)) if rng.random() < 0.8 else None
                rank = rb.choose(n, step, tau, curve)
                assert rank in grid and rank <= tau, (case, n, rank, tau)
                rb.commit(n, rank)
                assert rb.held_bytes() <= rb.budget, (case, step, n, rb.held_bytes(), rb.budget)


# ------------------------------------------------------------------------------------------- tiny-model runs
def projected_bytes_from_tensors(method) -> int:
    """Bytes of every state tensor the method lists, minus the dense parameters' own moments (by identity)."""
    dense = {id(t) for s in method.opt.slots if not s.projected for t in (s.m, s.v) if t is not None}
    return sum(t.numel() * t.element_size() for t in method.state_tensors() if id(t) not in dense)


def budgeted_run(model, steps: int, batch: int = 2, **kw) -> tuple[object, list[int]]:
    """Train ``steps`` steps (``batch`` × 16 tokens); the projected state measured after every refresh (inside
    backward with per_layer) and after every step."""
    method = hmt.make(hmt.Config(**kw))
    method.attach(model, max_grad_norm=1.0)
    seen, refresh = [], method.opt.refresh

    def measured_refresh(s, grad):
        refresh(s, grad)
        seen.append(projected_bytes_from_tensors(method))

    method.opt.refresh = measured_refresh
    step = lm_step(model, method.step, method.zero_grad, method.start_micro_batch)
    for x in batches(steps, batch=batch):
        step(x)
        seen.append(projected_bytes_from_tensors(method))
    return method, seen


@pytest.mark.parametrize("mode,per_layer,dtype", [("A", True, torch.bfloat16), ("A", False, torch.bfloat16),
                                                  ("B", True, torch.bfloat16), ("B", False, torch.bfloat16),
                                                  ("B", True, torch.float64)])
def test_projected_state_never_exceeds_the_budget(mode, per_layer, dtype):
    """bf16 (or fp64: an fp64 basis and limiter norm) weights, fp32 state, τ = 0.999 (every layer wants its
    largest rank) and 12% of AdamW's state: the budget binds at every refresh; measured after each refresh and
    each step it is never exceeded."""
    model = tiny_llama(dtype=dtype)
    method, seen = budgeted_run(model, 5, mode=mode, per_layer=per_layer, tau=0.999, update_interval=2,
                                rank_candidates=(8, 16, 32, 64), state_budget="0.12")
    budget = method.opt.budget.budget
    adamw = sum(2 * s.param.numel() * s.param.element_size() for s in method.opt.slots if s.projected)
    assert budget == int(0.12 * adamw)
    assert max(seen) <= budget, (max(seen), budget)
    assert max(seen) > 0.8 * budget, (max(seen), budget)  # and it is used, not wasted
    # the allocator's byte model is the tensors' bytes exactly (moments, basis, Mode B's limiter norm)
    assert method.opt.budget.held_bytes() == seen[-1], (method.opt.budget.held_bytes(), seen[-1])
    assert len(seen) == 5 + 3 * 14  # 14 projected weights refreshed at steps 0, 2, 4
    summary, metrics = method.summary(), method.metrics()
    capped = summary["rank/budget_capped"]
    assert capped and all(r < t for h in capped.values() for _, r, t in h)  # the budget capped, τ asked more
    assert metrics["rank/capped_layers"] > 0 and metrics["optim/state_budget_bytes"] == budget
    assert summary["optim/projected_state_bytes"] == seen[-1] == metrics["optim/projected_state_bytes"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kw", [dict(sides="two_sided"), dict(mode="B", basis="random", scaling="tensor"),
                                dict(mode="B", sides="two_sided", scaling="tensor"), dict(state_dtype="bf16"),
                                dict(rank_fallback="full", basis="svd")])
def test_byte_model_is_the_state_tensors_bytes(kw, dtype):
    """The allocator's bytes per layer (``layer_state_bytes``) equal the bytes of the tensors the optimizer then
    holds, for every layout, scaling, weight dtype and state dtype (Mode B's limiter norm included)."""
    method, seen = budgeted_run(tiny_llama(dtype=dtype), 3, tau=0.999, update_interval=2,
                                rank_candidates=(8, 16, 32, 64), state_budget="0.12", **kw)
    assert method.opt.budget.held_bytes() == seen[-1] and max(seen) <= method.opt.budget.budget


def galore_sized_llama() -> LlamaForCausalLM:
    """The tiny phase's layer shapes (h 256, MLP 688; GaLore's rank 128 fits), two layers, a small vocabulary."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def test_default_keeps_no_more_projected_state_than_galore_torch():
    """galore-torch's GaLoreAdamW at its default rank (baselines/galore.py) on a bf16 model: its projected state
    (exp_avg, exp_avg_sq, ortho_matrix of the projected weights) is what ``"galore"`` resolves to, byte for byte;
    default HMT stays at or below it at every moment, while HMT without a budget (τ = 0.999 asks for full rank)
    keeps more. Dense parameters (embeddings, norms, lm_head) are outside the budget; HMT keeps their moments in
    the weight's dtype by default (``dense_state_dtype="weight"``: bf16 here) as galore-torch does, so the whole
    optimizer state is at or below galore-torch's too (with fp32 dense moments it was above)."""
    data = batches(1, batch=16)
    model = galore_sized_llama()
    ref = galore.make(galore.Config())
    ref.attach(model, max_grad_norm=1.0)
    lm_step(model, ref.step, ref.zero_grad)(data[0])
    names = hmt.projected_weight_names(model, galore.Config().target_patterns)
    lowrank = [p for n, p in model.named_parameters() if n in names]
    opt_state = ref.driver.optimizer.state
    galore_projected = sum(t.numel() * t.element_size() for p in lowrank for t in iter_state_tensors(opt_state[p]))
    assert galore_projected == sum(galore_state_bytes(tuple(p.shape), GALORE_DEFAULT_RANK, 2) for p in lowrank)

    # 16 × 16 tokens: a gradient's rank is at most the token count, and τ = 0.999 then asks for the full 256
    default, seen = budgeted_run(galore_sized_llama(), 3, batch=16, tau=0.999, update_interval=2)
    unbounded, seen_none = budgeted_run(galore_sized_llama(), 3, batch=16, tau=0.999, update_interval=2,
                                        state_budget=None)
    print(f"projected state: galore-torch {galore_projected:,} B, HMT default {max(seen):,} B, HMT without a budget "
          f"{max(seen_none):,} B; whole optimizer state: galore-torch {ref.summary()['optim/state_bytes']:,} B, "
          f"HMT default {default.summary()['optim/state_bytes']:,} B")
    assert default.opt.budget.budget == galore_projected
    assert max(seen) <= galore_projected < max(seen_none), (max(seen), galore_projected, max(seen_none))
    assert default.summary()["optim/state_bytes"] <= ref.summary()["optim/state_bytes"]
    fp32_dense, _ = budgeted_run(galore_sized_llama(), 1, batch=16, tau=0.999, update_interval=2,
                                 dense_state_dtype="fp32")
    assert fp32_dense.summary()["optim/state_bytes"] > ref.summary()["optim/state_bytes"], "negative control"


@pytest.mark.parametrize("per_layer", [True, False])
def test_first_round_is_close_to_the_allocation_with_every_spectrum_known(per_layer):
    """The first refresh knows only the spectra seen so far (rank_budget's module doc). Its Σ E(r) against the
    knapsack optimum over all of that round's spectra (a pre-pass would find it): measured 0.966–0.997 on these
    models and budgets; 0.95 is a regression bound, not a guarantee."""
    cases = [(galore_sized_llama(), 16, dict(tau=0.999)), (galore_sized_llama(), 16, dict(state_budget="0.05")),
             (tiny_llama(dtype=torch.bfloat16), 2, dict(tau=0.999, rank_candidates=(8, 16, 32, 64),
                                                        state_budget="0.12"))]
    for model, batch, kw in cases:
        method = hmt.make(hmt.Config(per_layer=per_layer, **kw))
        method.attach(model, max_grad_norm=1.0)
        lm_step(model, method.step, method.zero_grad, method.start_micro_batch)(batches(1, batch=batch)[0])
        rb = method.opt.budget
        values = [[x.curve[j] for j in x.allowed()] for x in rb.layers.values()]
        costs = [[x.costs[j] for j in x.allowed()] for x in rb.layers.values()]
        best = exact_optimum(values, costs, rb.budget)
        got = sum(x.curve[x.grid.index(x.held)] for x in rb.layers.values())
        print(f"first round, per_layer={per_layer}, {kw}: Σ E {got:.4f} of the optimum {best:.4f}")
        assert rb.held_bytes() <= rb.budget and got >= 0.95 * best, (kw, got, best)


def test_dry_run_ranks_fill_the_budget_without_exceeding_it():
    """Shape-only gradients have no spectrum: every layer uses the flat prior, which spends the budget."""
    model = tiny_llama(dtype=torch.bfloat16)
    method = hmt.make(hmt.Config(rank_candidates=(8, 16, 32, 64), state_budget="0.12", per_layer=False))
    method.attach(model, max_grad_norm=None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for s in method.opt.slots:
            if s.projected:
                method.opt.refresh(s, torch.empty(s.param.shape, dtype=s.param.dtype))
                assert method.opt.projected_state_bytes() <= method.opt.budget.budget
    held, budget = method.opt.projected_state_bytes(), method.opt.budget.budget
    print(f"dry run: {held:,} of {budget:,} bytes")
    assert 0.9 * budget < held <= budget  # measured 98.9 %: the bound a dry run reports is the budget's


def test_runner_reports_the_budget(tmp_path):
    run_runner(tmp_path, "method=hmt", "method.state_budget=0.1", "method.tau=0.999", "method.update_interval=1",
               "train.steps=3", "train.eval_every=3")
    import json

    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and (p / "summary.json").exists()]
    summary = json.loads((run_dir / "summary.json").read_text())["method_summary"]
    assert 0 < summary["optim/projected_state_bytes"] <= summary["optim/state_budget_bytes"]
    assert summary["rank/budget_capped"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["optim/projected_state_bytes"] <= r["optim/state_budget_bytes"] for r in rows if "step" in r)


# ------------------------------------------------------------------------------------------------------ resume
def test_resume_from_a_checkpoint_keeps_the_allocation(tmp_path):
    """Stop after step 3 (refreshes at 0 and 2), checkpoint through experiments.checkpoint.store, resume in a fresh
    model + method: the refreshes at 4 and 6 allocate exactly as in the uninterrupted run (the curves of the layers
    still to refresh are part of the state), and every parameter is bit-identical."""
    kw = dict(tau=0.999, update_interval=2, rank_candidates=(8, 16, 32, 64), state_budget="0.2")
    data = batches(7, batch=2)
    model = tiny_llama(dtype=torch.bfloat16)
    method = hmt.make(hmt.Config(**kw))
    method.attach(model, max_grad_norm=1.0)
    step = lm_step(model, method.step, method.zero_grad, method.start_micro_batch)
    for x in data[:3]:
        step(x)
    ck.save_checkpoint(tmp_path, 3, {"model": ck.model_state(model), "method": method.state_dict()})
    for x in data[3:]:
        step(x)


    _, payload = ck.load_checkpoint(tmp_path / ck.step_dir_name(3))
    saved = payload["method"]["budget"]
    assert all(x["curve"] is not None and x["held"] is not None for x in saved["layers"].values())
    resumed = tiny_llama(seed=5, dtype=torch.bfloat16)
    ck.load_model_state(resumed, payload["model"])
    method2 = hmt.make(hmt.Config(**kw))
    method2.attach(resumed, max_grad_norm=1.0)
    method2.load_state_dict(payload["method"])
    assert method2.opt.budget.state_dict() == saved  # what the refreshes at 4 and 6 predict from
    step2 = lm_step(resumed, method2.step, method2.zero_grad, method2.start_micro_batch)
    for x in data[3:]:
        step2(x)
    assert method2.summary()["rank/history"] == method.summary()["rank/history"]
    assert method2.summary()["rank/budget_capped"] == method.summary()["rank/budget_capped"]
    assert method.summary()["rank/budget_capped"]  # the budget did cap (else the test shows nothing)
    assert method2.opt.budget.state_dict() == method.opt.budget.state_dict()
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
