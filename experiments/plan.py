"""``python -m experiments.plan model=7b train.seq_len=2048 budget_gib=16`` — will it fit? A memory-budget planner.

Chooses, for ``method=hmt`` on any model the runner takes (phases, ``model.path=`` configs, any override of
``experiments.run``), the optimizer setting (Mode A with an optimizer-state budget ``method.state_budget``, within
which HMT's own allocator picks per-layer ranks, or Mode B = APOLLO-Mini; state dtype, projected LM head,
bitsandbytes 8-bit dense state, INT8 projected weights), the action of each activation component (keep / recompute
/ int8 …, or full layer recomputation) and the micro-batch size that maximize tokens per micro-batch, then
retained gradient energy, then step time, under ``budget_gib`` less the GPU allowance
(``experiments.gpu_allowance.reserve_bytes``: CUDA context, cuBLAS workspaces, NCCL buffers; with
``dryrun.reserve=flat``, ``dryrun.cuda_context_gib``):

1. costs: dry-run traces of 1- and 2-layer models at full width (``experiments.plan_costs``), FLOPs and a
   calibrated time model (``experiments.plan_model``);
2. an integer program solved with ``scipy.optimize.milp`` (``experiments.plan_milp``; after Adacc, Chen et al.
   2025);
3. verification: the plan is written as a Hydra config (``experiments/conf/plan/<name>.yaml``, package
   ``_global_``) and run AS IS as a real ``mode=dryrun`` of the full model; if its peak (the dry run's verdict
   peak: the step's or the activation probe's; with ``dryrun.reserve=modeled`` the caching allocator's predicted
   reserved bytes, ``experiments.gpu_allowance.step_bytes``) exceeds the budget, the MILP is tightened phase by
   phase by the measured error (per sequence for forward and backward, which grow with the micro-batch; as bytes
   for the optimizer phase and the probe) and by the allocator's measured slack beyond the live peak, and solved
   again (at most ``max_iters`` times).

Run the plan with ``python -m experiments.run +plan=<name>`` (``hydra.searchpath=[file://<plan_dir>]`` first when
``plan_dir=`` put it elsewhere). Planner keys (the rest are ``experiments.run`` overrides): ``budget_gib``,
``batch_size`` (a fixed micro-batch: the budget then goes to energy and time), ``name``, ``plan_dir``, ``verify``,
``max_iters``, ``calibration``, ``refresh_costs`` and the choice space ``modes, state_budgets, state_dtypes,
weight_dtypes, dense_8bit, project_head, actions, layer_recompute, max_batch_size``
(``experiments.plan_costs.Space``); ``--capacity`` (``experiments.plan_capacity``) and ``--calibrate``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from experiments.errors import UserError, one_line_errors
from experiments.gpu_allowance import reserve_bytes, reserve_label, step_bytes
from experiments.plan_costs import GIB, Space, derive, measure, target_layers
from experiments.plan_milp import min_peak, solve
from experiments.plan_model import build_problem, calibrate, param_bytes, region_flops, weight_stats
from experiments.plan_report import model_label, plan_record, render_plan, run_command

CONF_DIR = Path(__file__).resolve().parent / "conf"
PLAN_NODES = ("model", "method", "activation", "train", "data", "dryrun")
SPACE_KEYS = ("modes", "state_budgets", "state_dtypes", "weight_dtypes", "dense_8bit", "project_head", "actions",
              "layer_recompute", "max_batch_size")
KEYS = {"budget_gib": (int, float), "batch_size": int, "name": str, "plan_dir": str, "verify": bool, "max_iters": int,
        "calibration": str, "refresh_costs": bool, "capacity": bool, "calibrate": bool, "methods": list,
        "readme": str, **{k: (list, int) for k in SPACE_KEYS}}


def parse_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Planner keys (``key=value``, values in YAML) and the ``experiments.run`` overrides."""
    planner, overrides = {}, []
    for token in argv:
        if token in ("--capacity", "--calibrate"):
            planner[token[2:]] = True
            continue
        if token.startswith("-"):
            raise UserError(f"unknown flag {token!r}; flags: --capacity, --calibrate (everything else is key=value)")
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

    import experiments.run  # noqa: F401  (registers the structured configs)
    from experiments.sweep import checked

    extra = [f"hydra.searchpath=[file://{Path(plan_dir).resolve()}]"] if plan_dir is not None else []

    def make():
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="run", overrides=[*extra, *overrides])

    return checked("experiments.plan", make)


def run_config(overrides: Sequence[str]):
    from experiments.sweep import checked, validated_run_config

    cfg = compose(overrides)
    return checked("experiments.plan", lambda: validated_run_config(cfg))


def space_from(planner: dict) -> Space:
    values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in planner.items() if k in SPACE_KEYS}
    try:
        return Space(**values)
    except (TypeError, ValueError) as e:
        raise UserError(f"planner choice space: {e}") from None


def plan_name(run, budget_gib: float, batch_size: int | None = None) -> str:
    return f"{model_label(run)}-s{run.train.seq_len}-{budget_gib:g}gib" + (f"-b{batch_size}" if batch_size else "")


def _plain(obj):
    return json.loads(json.dumps(obj, default=list))


def plan_nodes(run, solution, space: Space) -> dict:
    """The run configuration of a solution as the top-level nodes a ``_global_`` plan config sets."""
    import dataclasses

    from experiments.config import to_plain_dict
    from experiments.plan_costs import policy_for

    choice = solution.option.payload
    method = dataclasses.replace(run.method, **choice.method_changes(run.method))
    policy = policy_for(run.activation, bool(solution.actions), **solution.actions,
                        layer_recompute=solution.layer_recompute)
    train = dataclasses.replace(run.train, batch_size=solution.batch)
    plain = to_plain_dict(dataclasses.replace(run, method=method, activation=policy, train=train))
    nodes = {k: _plain(plain[k]) for k in PLAN_NODES}
    nodes["activation"] = {"preset": "none", **_plain(policy.to_dict())}
    return nodes


def write_plan_yaml(path: Path, nodes: dict, header: list[str]) -> None:
    from experiments.results import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# @package _global_\n" + "".join(f"# {line}\n" for line in header)
    atomic_write_text(path, text + yaml.safe_dump(nodes, sort_keys=False))


def verify_plan(name: str, plan_dir: Path | None, results: Path) -> dict:
    """A real ``mode=dryrun`` of the plan config as written (in this process); its summary."""
    from experiments.run import main_with_config

    cfg = compose([f"+plan={name}", "mode=dryrun", f"results_dir={results}", "run_id=verify", "force=true"],
                  plan_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        return main_with_config(cfg)


def load_calibration(planner: dict, run) -> dict:
    path = planner.get("calibration")
    if path is None:
        from experiments.models import TORCH_DTYPES

        return {**calibrate("cpu", TORCH_DTYPES[run.model.dtype]), "source": "measured now (cpu)"}
    try:
        return {**json.loads(Path(path).read_text()), "source": str(path)}
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"calibration={path}: cannot read a calibration file ({e})") from None


@dataclass
class Prepared:
    """Everything measured once per (model, settings): weights, traced costs, FLOPs, calibration."""

    run: object
    space: Space
    layers: int
    stats: dict
    llama: bool
    record: dict
    costs: object
    flops: dict
    cal: dict
    weights_gib: float
    lowest: str  # the weight dtype with the fewest bytes

    @property
    def floor_gib(self) -> float:
        return self.weights_gib + reserve_bytes(self.run) / GIB


def prepare(run, planner: dict, *, log=print) -> Prepared:
    space = space_from(planner)
    layers = target_layers(run)
    stats = weight_stats(run, space.weight_dtypes)
    lowest = min(space.weight_dtypes, key=lambda w: param_bytes(stats, layers, w))
    budget = planner.get("budget_gib")
    weights = param_bytes(stats, layers, lowest) / GIB
    ctx = reserve_bytes(run) / GIB
    if budget is not None and budget < weights + ctx:  # before any trace
        raise UserError(f"budget_gib={budget:g} is below the floor of {model_label(run)}: its weights alone take "
                        f"{weights:.2f} GiB ({lowest} projected weights) + {reserve_label(run)} {ctx:.2f} = "
                        f"{weights + ctx:.2f} GiB")
    llama = stats["L1"]["llama"]
    results = Path(run.results_dir).expanduser()
    record = measure(run, space, llama=llama, cache_dir=results / "plan" / "costs",
                     refresh=bool(planner.get("refresh_costs")), log=log)
    return Prepared(run, space, layers, stats, llama, record, derive(record, layers),
                    region_flops(run) if llama else {}, load_calibration(planner, run), weights, lowest)


class NoPlan(UserError):
    """No choice fits the budget at one sequence of ``train.seq_len`` tokens (predicted)."""


def plan_with(prep: Prepared, planner: dict, budget: float, *, seq_len: int | None = None, name: str | None = None,
              record_dir: Path | None = None, log=print) -> dict:
    """Solve, write the plan config, verify by a full dry run (tightening the MILP's budget on a miss); returns the
    plan record (also written as ``<record_dir>/<name>.json``; the verification run is ``<record_dir>/<name>/
    verify``). ``seq_len``: plan for other sequences than the measured ones (costs scaled per token)."""
    import dataclasses

    run = prep.run
    if seq_len is not None:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, seq_len=seq_len))
    ctx = reserve_bytes(run) / GIB
    if budget < prep.floor_gib:
        raise UserError(f"budget_gib={budget:g} is below the floor of {model_label(run)}: its weights alone take "
                        f"{prep.weights_gib:.2f} GiB ({prep.lowest} projected weights) + {reserve_label(run)} "
                        f"{ctx:.2f} = {prep.floor_gib:.2f} GiB")
    results = Path(run.results_dir).expanduser()
    record_dir = record_dir or results / "plan"
    name = name or planner.get("name") or plan_name(run, budget, planner.get("batch_size"))
    from experiments.config import RUN_ID

    if not RUN_ID.fullmatch(name):
        raise UserError(f"name={name!r} must be one file name: letters, digits and . _ = + - (no '/')")
    plan_dir = Path(planner["plan_dir"]).expanduser() if planner.get("plan_dir") else None
    plan_path = (plan_dir or CONF_DIR) / "plan" / f"{name}.yaml"
    step_budget = budget - ctx
    slack = 0.0  # GiB the allocator reserved beyond the live peak in the last verification (reserve=modeled)
    iterations, summary = [], None
    scale = run.train.seq_len / prep.record["seq_len"]
    static_fix: dict[str, float] = {}  # GiB added to a phase after a miss (phases that do not grow with b)
    per_seq_fix: dict[str, float] = {}  # GiB per sequence added to forward/backward after a miss
    for _ in range(int(planner.get("max_iters", 6))):
        prob = tightened(build_problem(prep.costs, space=prep.space, record=prep.record, stats=prep.stats,
                                       flops=prep.flops, cal=prep.cal, budget_gib=step_budget - slack,
                                       llama=prep.llama,
                                       seq_scale=scale), static_fix, per_seq_fix)
        if planner.get("batch_size"):  # a fixed micro-batch: the budget goes to energy, then time
            prob = dataclasses.replace(prob, fixed_batch=int(planner["batch_size"]))
        sol = solve(prob)
        if sol is None:
            need = min_peak(prob) + ctx
            raise NoPlan(f"no plan fits budget_gib={budget:g} for {model_label(run)} at train.seq_len="
                         f"{run.train.seq_len}" + (f", batch_size={planner['batch_size']}" if planner.get("batch_size")
                                                   else "") +
                         f": the leanest choice needs {need:.2f} GiB at one sequence (predicted, "
                         f"{ctx:.2f} GiB {reserve_label(run)} included); lower train.seq_len or raise budget_gib")
        predicted = max(v for v in sol.predicted.values() if v is not None)
        header = [f"Memory plan by `python -m experiments.plan {' '.join(planner.get('_argv', []))}`".rstrip(),
                  (f"budget {budget:g} GiB = {step_budget:.2f} GiB for the step + {ctx:.2f} GiB {reserve_label(run)}; "
                   f"predicted peak {predicted:.2f} GiB"),
                  f"run it: {run_command(name, plan_dir)}"]
        write_plan_yaml(plan_path, plan_nodes(run, sol, prep.space), header)
        step = {"batch_size": sol.batch, "predicted_gib": sol.predicted, "predicted_peak_gib": predicted,
                "tightened_static_gib": dict(static_fix), "tightened_per_seq_gib": dict(per_seq_fix)}
        iterations.append(step)
        if planner.get("verify", True) is False:
            break
        log(f"verify: dry run of {plan_path.name} at full size (batch {sol.batch}, seq {run.train.seq_len}) ...")
        summary = verify_plan(name, plan_dir, record_dir / name)
        verified = step_bytes(summary["dryrun"], run)
        step["verified_peak_gib"] = verified / GIB
        log(f"verify: predicted {predicted:.3f} GiB, measured {verified / GIB:.3f} GiB "
            f"({'fits' if verified <= step_budget * GIB else 'over'} {step_budget:.2f} GiB)")
        if verified <= step_budget * GIB:
            break
        slack = max(slack, (verified - summary["dryrun"]["verdict_peak_bytes"]) / GIB)
        measured = {**{p: b / GIB for p, b in summary["memory"]["peak_by_phase_bytes"].items()},
                    "probe": ((summary.get("activation_summary") or {}).get("probe_peak_bytes") or 0) / GIB}
        for p, gib in measured.items():  # tighten each phase that is over by its measured error
            if gib > step_budget - slack:
                err = gib - (sol.predicted.get(p) or 0.0) + 1e-3 * step_budget
                if p in ("forward", "backward"):
                    per_seq_fix[p] = per_seq_fix.get(p, 0.0) + max(err, gib - step_budget + slack) / sol.batch
                else:
                    static_fix[p] = static_fix.get(p, 0.0) + max(err, gib - step_budget + slack)
    else:
        raise UserError(f"no verified plan for budget_gib={budget:g} after max_iters={len(iterations)} "
                        f"(last: predicted {iterations[-1]['predicted_peak_gib']:.2f} GiB, measured "
                        f"{iterations[-1].get('verified_peak_gib', float('nan')):.2f} GiB); raise max_iters")
    out = plan_record(run, sol, summary, command=planner.get("_argv", []), name=name, plan_path=plan_path,
                      plan_dir=plan_dir, budget=budget, floor=prep.floor_gib, iterations=iterations, cal=prep.cal, record=prep.record,
                      costs=prep.costs)
    from experiments.results import atomic_write_text

    record_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(record_dir / f"{name}.json", json.dumps(out, indent=1, sort_keys=True))
    return out


def tightened(prob, static_fix: dict[str, float], per_seq_fix: dict[str, float]):
    """``prob`` with its reference's bytes raised where a verification measured more than predicted: a phase that
    grows with the micro-batch (forward, backward) per sequence (the error at b sequences / b), the others by the
    error itself — the MILP's budget tightened phase by phase."""
    import dataclasses

    from experiments.plan_milp import Segment

    if not static_fix and not per_seq_fix:
        return prob
    base = tuple(Segment(s.start, {p: v + static_fix.get(p, 0.0) for p, v in s.static.items()},
                         {p: v + per_seq_fix.get(p, 0.0) for p, v in s.per_seq.items()}) for s in prob.base)
    return dataclasses.replace(prob, base=base)


def make_plan(run, planner: dict, *, log=print) -> dict:
    """Measure, solve, write, verify: ``prepare`` then ``plan_with`` at ``budget_gib``."""
    return plan_with(prepare(run, planner, log=log), planner, float(planner["budget_gib"]), log=log)


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body():
        planner, overrides = parse_args(argv)
        planner["_argv"] = argv
        run = run_config([o for o in overrides if not o.startswith("mode=")])
        if planner.get("calibrate"):
            return write_calibration(run)
        if run.method.name != "hmt":
            raise UserError(f"method={run.method.name}: the planner plans method=hmt (--capacity compares the "
                            "baselines)")
        from experiments.run import preflight

        preflight(run)
        if planner.get("capacity"):
            from experiments.plan_capacity import capacity

            return capacity(run, planner, overrides)
        if "budget_gib" not in planner:
            raise UserError("budget_gib= is required (the GPU's memory in GiB, e.g. budget_gib=16), or --capacity")
        rec = make_plan(run, planner)
        print(render_plan(rec))
        return rec

    return one_line_errors(body, FileNotFoundError)


def write_calibration(run) -> dict:
    from experiments.models import TORCH_DTYPES
    from experiments.results import atomic_write_text
    from experiments.run import resolve_device

    device = resolve_device(run.device)
    cal = calibrate(device.type, TORCH_DTYPES[run.model.dtype])
    slug = "".join(ch if ch.isalnum() else "-" for ch in cal["device"].lower()).strip("-")
    path = Path(run.results_dir).expanduser() / "plan" / f"calibration-{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(cal, indent=1, sort_keys=True))
    print(f"calibration on {cal['device']}: {cal['flops_per_s'] / 1e12:.3f} TFLOP/s, "
          f"{cal['bytes_per_s'] / 1e9:.1f} GB/s copy; written to {path} (use calibration={path})")
    return cal


if __name__ == "__main__":
    main()
