"""``python -m experiments.plan model=7b train.seq_len=2048 budget_gib=16`` — will it fit? A memory-budget planner.

Chooses, for ``method=hmt`` on any model the runner takes (phases, ``model.path=`` configs, any override of
``experiments.run``), the optimizer setting (Mode A with an optimizer-state budget ``method.state_budget``, within
which HMT's own allocator picks per-layer ranks, or Mode B = APOLLO-Mini; state dtype, projected LM head,
bitsandbytes 8-bit dense state, INT8 projected weights; INT8 embedding and LM head, the embedding updated by rows,
the head updated in the loss), the action of each activation component (keep / recompute / int8 …, or full layer
recomputation with its layer inputs kept or coded) and the micro-batch size: a micro-batch whose modeled throughput
is within ``efficiency_slack`` of the largest that fits (``experiments.planner.efficiency``), then the least expected
loss cost of the lossy choices (priced by the tuned campaign, ``experiments.planner.prices``), then retained
gradient energy, then step time, under ``budget_gib`` less the GPU allowance
(``experiments.memory.gpu_allowance.reserve_bytes``: CUDA context, cuBLAS workspaces, NCCL buffers; with
``dryrun.reserve=flat``, ``dryrun.cuda_context_gib``):

1. costs: dry-run traces of 1- and 2-layer models at full width (``experiments.planner.costs``), read from the
   committed cost table or the user's cache (``experiments.planner.cache``) and traced only where missing; FLOPs and
   a calibrated time model (``experiments.planner.model``);
2. an integer program solved with ``scipy.optimize.milp`` (``experiments.planner.milp``; after Adacc, Chen et al.
   2025) — the answer is the cost model's prediction;
3. with ``verify=true``: the plan, written as a Hydra config, is run AS IS as a real ``mode=dryrun`` of the full
   model; if its peak (the dry run's verdict peak; with ``dryrun.reserve=modeled`` the caching allocator's
   predicted reserved bytes, ``experiments.memory.gpu_allowance.step_bytes``) exceeds the budget, the cost model is
   corrected by what was measured (``Corrections``) and the MILP solved again (at most ``max_iters`` times).

Plans go to ``<results_dir>/plans/<name>.yaml`` and ``.json`` (``plan_dir=`` another folder; never the tracked
``experiments/conf/plan/`` or ``results/plan/``); the printed commands say which one trains and which one only
traces. Planner keys (the rest are ``experiments.run`` overrides): ``budget_gib``, ``batch_size`` (a fixed
micro-batch: the budget then goes to energy and time), ``name``, ``plan_dir``, ``verify``, ``max_iters``,
``calibration``, ``refresh_costs``, ``workers`` (processes for missing cost traces), ``ridge_flop_per_byte`` and
``efficiency_slack`` (the micro-batch efficiency model) and the choice space ``modes,
state_budgets, state_dtypes, weight_dtypes, dense_8bit, project_head, actions, layer_recompute, embedding_dtypes,
embedding_updates, head_updates, layer_inputs, max_batch_size`` (``experiments.planner.space.Space``);
``--capacity`` (``experiments.planner.capacity``), ``--calibrate`` and ``--table`` (complete this group of the
committed cost table; ``table_budgets=[16,24]`` adds the samples the unverified answers at those budgets need).
Design and measurements: ``docs/planner.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from experiments.config import RUN_ID, to_plain_dict
from experiments.errors import UserError
from experiments.execute import main_with_config
from experiments.memory.gpu_allowance import reserve_bytes, reserve_label, step_bytes
from experiments.planner.correct import Corrections
from experiments.planner.costs import GIB, Space, policy_for
from experiments.planner.efficiency import DEFAULT_RIDGE, Throughput
from experiments.planner.learning import learning_check
from experiments.planner.milp import min_peak
from experiments.planner.objective import loss_cost, throughput_model
# space_from: re-exported, the planner's API
from experiments.planner.prepare import SPACE_KEYS, Prepared, prepare, space_from  # noqa: F401
from experiments.planner.recipe import RATE_KEYS, run_recipe, user_set, written_rates
from experiments.planner.report import model_label, plan_record, plans_dir, run_command
from experiments.planner.streaming import micro_batch_time
from experiments.planner.verified import Verifier, next_choice, settle
from experiments.results import atomic_write_text
from experiments.step_time import CONFIRM_S
from experiments.sweeps.sweep import checked, validated_run_config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
PLAN_NODES = ("model", "method", "activation", "train", "data", "dryrun")
KEYS = {"budget_gib": (int, float), "batch_size": int, "name": str, "plan_dir": str, "verify": bool, "max_iters": int,
        "calibration": str, "refresh_costs": bool, "workers": int, "capacity": bool, "calibrate": bool, "table": bool,
        "methods": list, "readme": str, "table_budgets": list, "ridge_flop_per_byte": (int, float),
        "efficiency_slack": (int, float), "pcie_gb_per_s": (int, float), "peak_flops": (int, float),
        **{k: (list, int) for k in SPACE_KEYS if k != "mode_b_head"}, "mode_b_head": bool}
FLAGS = ("--capacity", "--calibrate", "--table")


def parse_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Planner keys (``key=value``, values in YAML) and the ``experiments.run`` overrides."""
    planner, overrides = {}, []
    for token in argv:
        if token in FLAGS:
            planner[token[2:]] = True
            continue
        if token.startswith("-"):
            raise UserError(f"unknown flag {token!r}; flags: {', '.join(FLAGS)} (everything else is key=value)")
        key, sep, value = token.partition("=")
        if sep and key in KEYS:
            parsed = yaml.safe_load(value) if value else None
            if not isinstance(parsed, KEYS[key]) or (KEYS[key] is not bool and isinstance(parsed, bool)):
                raise UserError(f"{key}={value!r}: expected {_type_name(KEYS[key])}")
            planner[key] = parsed
        else:
            overrides.append(token)
    return planner, overrides


def _type_name(t) -> str:
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def compose(overrides: Sequence[str], plan_dir: Path | None = None):
    """``experiments/conf/run.yaml`` composed with ``overrides`` (and ``plan_dir`` on the search path)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    extra = [f"hydra.searchpath=[file://{Path(plan_dir).resolve()}]"] if plan_dir is not None else []

    def make():
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="run", overrides=[*extra, *overrides])

    return checked("experiments.planner.plan", make)


def run_config(overrides: Sequence[str]):
    cfg = compose(overrides)
    return checked("experiments.planner.plan", lambda: validated_run_config(cfg))


def plan_name(run, budget_gib: float, batch_size: int | None = None) -> str:
    return f"{model_label(run)}-s{run.train.seq_len}-{budget_gib:g}gib" + (f"-b{batch_size}" if batch_size else "")


def _plain(obj):
    return json.loads(json.dumps(obj, default=list))


def written_recipe(run, choice, plan_path: Path, overrides: Sequence[str]) -> dict:
    """The rate and warm-up the plan file holds, and where they came from (the record's ``recipe``)."""
    nodes = yaml.safe_load(plan_path.read_text())
    mine = [k for k in (*(f"method.{key}" for key in RATE_KEYS), "train.warmup_steps") if user_set(overrides, k)]
    return {**{key: nodes["method"].get(key, 1.0) for key in RATE_KEYS},
            "warmup_steps": nodes["train"]["warmup_steps"],
            "steps": nodes["train"]["steps"],
            "source": run_recipe(run, choice).source + (f"; {', '.join(mine)} as given" if mine else "")}


def plan_nodes(run, solution, space: Space, overrides: Sequence[str] = ()) -> dict:
    """The run configuration of a solution as the top-level nodes a ``_global_`` plan config sets; the rate and
    warm-up from ``run_recipe`` unless ``overrides`` (the planner command's) set them."""
    import dataclasses

    choice = solution.option.payload
    rec = run_recipe(run, choice)
    warmup = run.train.warmup_steps if user_set(overrides, "train.warmup_steps") else rec.warmup_steps
    method = dataclasses.replace(run.method, **choice.method_changes(run.method),
                                 **written_rates(run, choice, overrides))
    policy = policy_for(run.activation, bool(solution.actions), **solution.policy_actions(),
                        layer_recompute=solution.layer_recompute)
    train = dataclasses.replace(run.train, batch_size=solution.batch, warmup_steps=warmup)
    plain = to_plain_dict(dataclasses.replace(run, method=method, activation=policy, train=train))
    nodes = {k: _plain(plain[k]) for k in PLAN_NODES}
    nodes["activation"] = {"preset": "none", **_plain(policy.to_dict())}
    return nodes


def write_plan_yaml(path: Path, nodes: dict, header: list[str]) -> None:
    text = "# @package _global_\n" + "".join(f"# {line}\n" for line in header)
    atomic_write_text(path, text + yaml.safe_dump(nodes, sort_keys=False))


def verify_plan(name: str, folder: Path, results: Path) -> dict:
    """A real ``mode=dryrun`` of the plan config ``folder/<name>.yaml`` as written (in this process); its summary."""
    cfg = compose([f"+{folder.name}={name}", "mode=dryrun", f"results_dir={results}", "run_id=verify", "force=true"],
                  folder.parent)
    with contextlib.redirect_stdout(io.StringIO()):
        return main_with_config(cfg)


class NoPlan(UserError):
    """No choice fits the budget at one sequence of ``train.seq_len`` tokens (predicted). ``excess_gib``: by how much
    the leanest choice is over the budget — measured (``traced``: the least step bytes of the verification traces
    that were all over) or else predicted."""

    excess_gib: float = float("inf")
    traced: bool = False


# What an answer without ``verify=true`` leaves free beside its predicted live peak, as a fraction of that peak: the
# caching allocator's slack (reserved beyond live bytes, ``dryrun.reserve=modeled``), which no cost sample predicts
# (``Corrections``). Measured on verified model-card plans: 11.0-18.5 % at 16-80 GiB, growing with the micro-batch
# (Qwen2.5-0.5B: 14.6 % at 16 GiB, 18.5 % at 80 GiB; docs/planner.md, "Allocator slack in an unverified answer"),
# the largest rounded up.
UNVERIFIED_SLACK = 0.19
# The same for a plan whose weights are streamed (``method.weight_offload=host``): the layers' weight blocks freed and
# allocated again each micro-batch leave more reserved beyond live: 23-32 % on the verified Llama-3.1-8B 12 GiB plan
# (micro-batches 7 to 4 × 2,048; docs/weight_streaming.md), the largest rounded up.
UNVERIFIED_STREAMED_SLACK = 0.32


def plan_with(prep: Prepared, planner: dict, budget: float, *, seq_len: int | None = None, name: str | None = None,
              record_dir: Path | None = None, log=print) -> dict:
    """Solve and write the plan config; with ``verify=true`` trace it at full size and, on a miss, correct the cost
    model by what was measured and solve again (``corrected``). Returns the plan record (also written as
    ``<record_dir>/<name>.json``, by default next to the plan). ``seq_len``: plan for other sequences than the
    measured ones (costs scaled per token)."""
    run = prep.run if seq_len is None else dataclasses.replace(
        prep.run, train=dataclasses.replace(prep.run.train, seq_len=seq_len))
    ctx = reserve_bytes(run) / GIB
    name = checked_name(prep, run, planner, budget, name, ctx)
    folder = plans_dir(run.results_dir, planner.get("plan_dir"))
    verify_dir, record_dir = (record_dir or prep.verify_dir) / name, record_dir or folder
    plan_path = folder / f"{name}.yaml"
    step_budget = budget - ctx
    live_budget = step_budget if planner.get("verify", False) else step_budget / (1 + UNVERIFIED_SLACK)
    fix, scale = Corrections(), run.train.seq_len / prep.record["seq_len"]
    summary, best = None, None  # best: (solution, summary) of the largest verified fit so far
    v = Verifier(write=functools.partial(write_plan, run, planner, prep.space, plan_path, budget=budget, ctx=ctx),
                 trace=functools.partial(traced_step, run, plan_path, verify_dir, step_budget=step_budget, log=log),
                 step_budget=step_budget)
    iterations, model = v.iterations, throughput_model(prep.cal, planner, run.train.seq_len)
    planner = {**planner, "_budget": budget, "_not_offered": []}
    for _ in range(int(planner.get("max_iters", 8))):
        prob, sol = next_choice(prep, planner, fix, live_budget, scale, log, model)
        if sol is None and best is not None:  # the leanest choice one sequence further was over: done
            break
        if sol is None:
            raise no_plan(run, planner, budget, need=min_peak(prob) + ctx, ctx=ctx, traced=iterations,
                          live_budget=None if planner.get("verify", False) else live_budget)
        if (streamed := streamed_live_budget(sol, planner, live_budget, step_budget)) is not None:
            live_budget = streamed  # solved again, leaving the streamed plans' allocator slack
            continue
        step = v.written(sol, live_budget, fix)
        if not planner.get("verify", False):
            break
        summary, verified = v.trace(step)
        if verified <= step_budget * GIB:
            best = (sol, summary)
            if fix.fitted(sol):
                break
            log(f"verify: fits; the leanest choice at {fix.lean_batch} sequences next (below {fix.over} over)")
            continue
        fix.learn(summary, sol, verified, step_budget)
        log(f"verify: cost model corrected by the measured errors; solving again ({fix.record()})")
    else:
        if best is None:
            raise no_verified_plan(budget, iterations)
    if best is not None:  # the largest verified fit, then the least-loss choice there (``verified.settle``)
        sol, summary = settle(prep, planner, fix, best, v, live_budget=live_budget, scale=scale, model=model, log=log)
    out = plan_record(run, sol, summary, command=planner.get("_argv", []), name=name, plan_path=plan_path,
                      plan_dir=folder, budget=budget, floor=prep.floor_gib, iterations=iterations, cal=prep.cal,
                      record=prep.record, costs=prep.costs, train_note=train_note(prep, sol, run),
                      elapsed_s=round(time.perf_counter() - planner.get("_t0", time.perf_counter()), 1))
    # leanest_over_batch: the least micro-batch whose leanest choice a trace put over (or None)
    out.update(learning_record(run, planner, sol, prob, prep, model, plan_path, budget), leanest_over_batch=fix.over)
    record_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(record_dir / f"{name}.json", json.dumps(out, indent=1, sort_keys=True))
    return out


def streamed_live_budget(sol, planner: dict, live_budget: float, step_budget: float) -> float | None:
    """An unverified answer that streams its weights: the smaller live budget its allocator slack leaves, when the
    answer was solved with the larger one (``UNVERIFIED_STREAMED_SLACK``); else None."""
    streamed = step_budget / (1 + UNVERIFIED_STREAMED_SLACK)
    if sol.option.payload.offload == "host" and not planner.get("verify", False) and live_budget > streamed + 1e-9:
        return streamed
    return None


def learning_record(run, planner: dict, sol, prob, prep: Prepared, model: Throughput, plan_path: Path,
                    budget: float) -> dict:
    """The record's keys on learning: the rate written, the learning check's verdict, the expected loss cost, the
    settings not offered, the micro-batch's modeled throughput against the largest that fits, and its modeled
    time with a streamed plan's copies (``experiments.planner.streaming.micro_batch_time``)."""
    space = prep.space
    timed = micro_batch_time(prep.streaming, prep.stats, prep.layers, sol.batch * run.train.seq_len,
                             model.ridge if model is not None else DEFAULT_RIDGE,
                             streamed=sol.option.payload.offload == "host", weights=sol.option.payload.weights)
    recipe = written_recipe(run, sol.option.payload, plan_path, planner.get("_overrides", ()))
    return {"recipe": recipe,
            "learning_check": learning_check(model_label(run), budget, sol.option.payload.label(),
                                             {key: recipe[key] for key in RATE_KEYS}),
            "loss_cost": loss_cost(prob, sol, space), "not_offered": sorted(set(planner["_not_offered"])),
            "micro_batch": {"fits_up_to": sol.fit_batch, "model": dataclasses.asdict(model),
                            "relative_throughput": model.relative(sol.batch, sol.fit_batch or sol.batch,
                                                                  sol.option.transfer, sol.fit_transfer)},
            "micro_batch_time": timed}


def write_plan(run, planner: dict, space: Space, plan_path: Path, sol, *, budget: float, ctx: float) -> float:
    """Writes ``sol`` as the plan config at ``plan_path``; returns its predicted peak (GiB)."""
    predicted = max(v for v in sol.predicted.values() if v is not None)
    header = plan_header(run, planner, plan_path.stem, plan_path.parent, budget=budget, ctx=ctx, predicted=predicted)
    write_plan_yaml(plan_path, plan_nodes(run, sol, space, planner.get("_overrides", ())), header)
    return predicted


def no_verified_plan(budget: float, iterations: list[dict]) -> UserError:
    return UserError(f"no verified plan for budget_gib={budget:g} after max_iters={len(iterations)} "
                     f"(last: predicted {iterations[-1]['predicted_peak_gib']:.2f} GiB, measured "
                     f"{iterations[-1].get('verified_peak_gib', float('nan')):.2f} GiB); raise max_iters")


def traced_step(run, plan_path: Path, verify_dir: Path, step: dict, *, step_budget: float, log) -> tuple[dict, int]:
    """The written plan's dry run at full size: (its summary, the step bytes judged against ``step_budget`` GiB);
    ``step`` (the iteration's record) gains the measured peak and how long the trace took."""
    log(f"verify: dry run of {plan_path.name} at full size (batch {step['batch_size']}, seq {run.train.seq_len}) ...")
    t0 = time.perf_counter()
    summary = verify_plan(plan_path.stem, plan_path.parent, verify_dir)
    verified = step_bytes(summary["dryrun"], run)
    live = summary["dryrun"]["verdict_peak_bytes"] / GIB
    step.update(verified_peak_gib=verified / GIB, verified_live_gib=live, verify_s=round(time.perf_counter() - t0, 1))
    log(f"verify: predicted {step['predicted_peak_gib']:.3f} GiB, measured {verified / GIB:.3f} GiB "
        f"({'fits' if verified <= step_budget * GIB else 'over'} {step_budget:.2f} GiB; live peak {live:.3f} GiB; "
        f"{step['verify_s']:.0f} s)")
    return summary, verified


def checked_name(prep: Prepared, run, planner: dict, budget: float, name: str | None, ctx: float) -> str:
    """The plan's name (``name=``, or one made of the model, budget and batch), after refusing a budget below the
    model's floor (its leanest weights + the GPU allowance ``ctx`` GiB) and a name that is not one file name."""
    if budget < prep.floor_gib:
        raise UserError(f"budget_gib={budget:g} is below the floor of {model_label(run)}: its weights alone take "
                        f"{prep.weights_gib:.2f} GiB ({prep.lowest}) + {reserve_label(run)} "
                        f"{ctx:.2f} = {prep.floor_gib:.2f} GiB")
    name = name or planner.get("name") or plan_name(run, budget, planner.get("batch_size"))
    if not RUN_ID.fullmatch(name):
        raise UserError(f"name={name!r} must be one file name: letters, digits and . _ = + - (no '/')")
    return name


def plan_header(run, planner: dict, name: str, folder: Path, *, budget: float, ctx: float,
                predicted: float) -> list[str]:
    """The plan file's comment lines: the command, the budget's split (GiB), the commands that train and trace it."""
    return [f"Memory plan by `python -m experiments.plan {' '.join(planner.get('_argv', []))}`".rstrip(),
            (f"budget {budget:g} GiB = {budget - ctx:.2f} GiB for the step + {ctx:.2f} GiB {reserve_label(run)}; "
             f"predicted peak {predicted:.2f} GiB"),
            f"TRAINS: {run_command(name, folder)}", f"only TRACES (dry run): {run_command(name, folder, dryrun=True)}"]


def no_plan(run, planner: dict, budget: float, *, need: float, ctx: float, traced: list[dict],
            live_budget: float | None = None) -> NoPlan:
    """The error when no choice fits: what the leanest one needs (GiB, ``ctx`` GiB of GPU allowance included);
    ``traced``: the verification steps that were over (each with ``verified_peak_gib``); ``live_budget``: an
    unverified answer's room for the live peak (``UNVERIFIED_SLACK``), said with its remedy."""
    corrected = bool(traced)
    batch = f", batch_size={planner['batch_size']}" if planner.get("batch_size") else ""
    slack = "" if live_budget is None else (
        f"; unverified, the live peak must stay ≤ {live_budget:.2f} GiB to leave {UNVERIFIED_SLACK:.0%} of it for "
        f"the caching allocator's slack: verify=true traces the leanest choice instead")
    err = NoPlan(f"no plan fits budget_gib={budget:g} for {model_label(run)} at train.seq_len={run.train.seq_len}"
                  f"{batch}: the leanest choice needs {need:.2f} GiB at one sequence ("
                  f"{'corrected by the verification traces' if corrected else 'predicted'}, "
                  f"{ctx:.2f} GiB {reserve_label(run)} included){slack}; lower train.seq_len or raise budget_gib")
    err.traced = corrected
    err.excess_gib = min(s["verified_peak_gib"] for s in traced) + ctx - budget if traced else need - budget
    return err


def train_note(prep: Prepared, sol, run) -> str:
    """How long one optimizer step of the plan takes on the calibrated device (time model: FLOPs of forward +
    backward ≈ 3 × forward, at the calibrated matmul rate), and the confirmation a long CPU run asks for."""
    per_seq = prep.flops.get("layer", 0.0) * prep.layers + prep.flops.get("lm_head", 0.0)
    if not per_seq:
        return ""
    seconds = 3 * per_seq * sol.batch * run.train.grad_accum * (run.train.seq_len / prep.record["seq_len"]) \
        / prep.cal["flops_per_s"] + sol.time
    return (f"about {seconds:,.0f} s per optimizer step on {prep.cal.get('device', '?')} (time model)"
            + ("; on a CPU the run asks first (train.confirm=true: no question)"
               if seconds > CONFIRM_S and prep.cal.get("device") == "cpu" else ""))


def make_plan(run, planner: dict, *, log=print) -> dict:
    """Measure, solve, write, verify: ``prepare`` then ``plan_with`` at ``budget_gib``."""
    return plan_with(prepare(run, planner, log=log), planner, float(planner["budget_gib"]), log=log)
