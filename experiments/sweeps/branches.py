"""Cool-down branches of warmup-stable-decay trunks: the loss at several horizons for about the cost of the longest
run (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations").

A sweep file with a ``branches`` block::

    common: [train.schedule=wsd, train.cooldown_frac=0.2, train.steps=4800, train.checkpoint_every=240,
             train.keep_checkpoints=0, ...]
    runs: [...]                        # each final (non-search) run is a trunk
    branches:
      horizons: [300, 600, 1200, 2400]  # one branch each (shorter than the trunk, or longer: an extension)
      results_dir: results/wsd-branches # optional; default <the trunk's results_dir>-branches

Under ``train.schedule=wsd`` (``experiments.loop.lr_scale``) the rate before the cool-down's first step
D = H − ``cooldown_steps(H, cooldown_frac)`` does not depend on the horizon H, and the data order is a function of
(seed, step): a run of H steps equals its trunk up to D. So the branch of horizon H is that run — the trunk's
overrides with ``train.steps=H`` — started from the trunk's checkpoint at step D instead of from step 0: the
checkpoint is copied into the branch's own checkpoint folder, its recorded configuration set to the branch's (the
only difference is ``train.steps``; the trunk's folder and step are kept in the manifest as ``branched_from``), and
the runner resumes it as any preempted run (``train.resume=auto``; its rate at D is the trunk's, 1 × lr). A horizon
longer than the trunk's N continues the trunk: up to N's own cool-down start D_N the H-step run equals the trunk as
well, so it starts from the trunk's checkpoint at D_N and runs H − D_N steps (the trunk's cool-down is the only part
not shared). Two extensions H > h > N share more: the H-step run equals the h-step branch up to h's cool-down
start D_h > D_N, so H starts from that branch's checkpoint at D_h when it holds one (its longest such sibling; else
the trunk's D_N), and runs H − D_h steps (the manifest's ``branched_from`` names that run too). A completed branch
is skipped; a preempted or killed one resumes from its newest checkpoint; the trunk must be completed and hold a
checkpoint at each D (``train.checkpoint_every`` dividing every D, ``train.keep_checkpoints=0``), else one ``error:``
line says which.

CLI::

    python -m experiments.sweeps.branches <sweep> [--list] [overrides]   launch (or list) every branch

Branches run one after another (``python -m experiments.run``), each in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from experiments.errors import OneLineErrorParser, UserError, one_line_errors
from experiments.sweeps.files import read_sweep_spec, resolve_sweep_path
from experiments.sweeps.overrides import merge_overrides
from experiments.sweeps.tuning import is_search_run

MANIFEST = "manifest.json"


@dataclass(frozen=True, kw_only=True)
class BranchSpec:
    """The ``branches`` block of a sweep file."""

    horizons: tuple[int, ...]
    results_dir: str | None = None


@dataclass(frozen=True, kw_only=True)
class Branch:
    """One cool-down branch: its overrides, where its trunk is, and the trunk step it starts from; ``via``: the
    (horizon, cool-down start) of its longer-than-the-trunk siblings shorter than it, longest first, whose checkpoint
    at that start it starts from instead when one is there (``start_point``)."""

    job: tuple[str, ...]
    trunk: Path
    horizon: int
    start: int
    via: tuple[tuple[int, int], ...] = ()


def parse_branches(block) -> BranchSpec:
    """``BranchSpec`` of a sweep file's ``branches`` block; ``UserError`` naming what is wrong."""
    if not isinstance(block, dict) or set(block) - {"horizons", "results_dir"} or "horizons" not in block:
        raise UserError(f"`branches` must be a mapping with `horizons: [steps, ...]` (and optionally `results_dir`), "
                        f"got {block!r}")
    horizons = block["horizons"]
    if not isinstance(horizons, list) or not horizons or not all(
            isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in horizons):
        raise UserError(f"`branches.horizons` must be a non-empty list of positive step counts, got {horizons!r}")
    return BranchSpec(horizons=tuple(sorted(set(horizons))), results_dir=block.get("results_dir"))


def read_branch_spec(sweep: str | Path) -> BranchSpec:
    path = resolve_sweep_path(sweep)
    spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if "branches" not in spec:
        raise UserError(f"{path}: no `branches` block (horizons to branch the trunks at)")
    try:
        return parse_branches(spec["branches"])
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def branch_start(horizon: int, cooldown_frac: float) -> int:
    """The step a branch of ``horizon`` steps leaves its trunk: its cool-down's first step."""
    from experiments.config import cooldown_steps

    return horizon - cooldown_steps(horizon, cooldown_frac)


def trunk_branches(job: Sequence[str], trunk: Path, spec: BranchSpec) -> list[Branch]:
    """The branches of one completed trunk (its folder ``trunk``, config.yaml read from it)."""
    config = yaml.safe_load((trunk / "config.yaml").read_text())
    train = config["train"]
    if train.get("schedule", "cosine") != "wsd":
        raise UserError(f"{trunk}: trunk runs with train.schedule={train.get('schedule', 'cosine')}; cool-down "
                        "branches need train.schedule=wsd")
    out_dir = spec.results_dir or f"{config['results_dir'].rstrip('/')}-branches"
    steps, frac = int(train["steps"]), train["cooldown_frac"]
    longer = sorted((h for h in spec.horizons if h > steps), reverse=True)
    return [Branch(job=tuple(merge_overrides(list(job), [f"train.steps={h}", f"results_dir={out_dir}"])),
                   trunk=trunk, horizon=h,
                   start=min(branch_start(h, frac), branch_start(steps, frac)),  # longer: from the trunk's cool-down
                   via=tuple((g, branch_start(g, frac)) for g in longer if g < h))
            for h in spec.horizons if h != steps]


def start_point(branch: Branch, run_dir: Callable[[Sequence[str]], Path]) -> tuple[Path, int]:
    """(run folder, step) the branch starts from: the longest sibling of ``branch.via`` whose folder
    (``run_dir(job)``) holds a checkpoint at its cool-down start, else the trunk at ``branch.start``."""
    from experiments.checkpoint import store as ck

    for horizon, step in branch.via:
        sibling = run_dir(tuple(merge_overrides(list(branch.job), [f"train.steps={horizon}"])))
        if step in dict(ck.list_checkpoints(sibling / "checkpoints")):
            return sibling, step
    return branch.trunk, branch.start


def seed_checkpoint(branch: Branch, branch_dir: Path, branch_config: dict,
                    origin: tuple[Path, int] | None = None) -> Path | None:
    """Copies the checkpoint of ``origin`` (run folder, step; default the trunk at ``branch.start``) into the
    branch's checkpoint folder with the branch's configuration recorded, unless the branch already has a checkpoint
    (a resumed branch); the copy, or None."""
    from experiments.checkpoint import store as ck

    root = branch_dir / "checkpoints"
    if ck.list_checkpoints(root):
        return None
    run, start = origin or (branch.trunk, branch.start)
    found = {step: path for step, path in ck.list_checkpoints(run / "checkpoints")}
    if start not in found:
        raise UserError(f"{run}: no checkpoint at step {start}, where the {branch.horizon}-step "
                        f"branch starts (has {sorted(found) or 'none'}); rerun the trunk with train.checkpoint_every "
                        "dividing every branch start and train.keep_checkpoints=0")
    source = found[start]
    manifest = ck.verify(source)
    saved = manifest["meta"]["config"]
    manifest["meta"]["config"] = {**saved, "train": {**saved["train"], "steps": branch_config["train"]["steps"]}}
    manifest["meta"]["branched_from"] = {"trunk": str(branch.trunk), "run": str(run), "step": start}
    staging = root / f".{source.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in manifest["files"]:
        shutil.copy2(source / name, staging / name)
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    os.rename(staging, root / source.name)
    return root / source.name


def all_branches(sweep: str, overrides: Sequence[str]) -> list[Branch]:
    """Every branch of the sweep's completed final (non-search) runs, in sweep order; a trunk not yet completed
    is named on stderr and skipped."""
    from experiments.sweeps.sweep import run_lookup, run_ref_for, run_state, sweep_jobs

    spec = read_branch_spec(sweep)
    read_sweep_spec(sweep)  # validates the rest of the file
    branches = []
    for job in sweep_jobs(sweep, list(overrides), lookup=run_lookup()):
        if is_search_run(job):
            continue
        trunk = run_ref_for(job).path
        if run_state(trunk) != "completed":
            print(f"trunk {trunk}: {run_state(trunk)}, its branches wait", file=sys.stderr)
            continue
        branches += trunk_branches(job, trunk, spec)
    return branches


def launch(branches: Sequence[Branch], run: Callable[[list[str]], int] | None = None) -> dict[str, int]:
    """Runs every branch not completed (seeding its checkpoint first); counts of launched / skipped / failed."""
    from experiments.config import to_plain_dict
    from experiments.sweeps.sweep import compose_run_config, run_ref_from_config, run_state, validated_run_config

    run = run or (lambda job: subprocess.call([sys.executable, "-m", "experiments.run", *job]))
    def run_dir(job: Sequence[str]) -> Path:
        return run_ref_from_config(compose_run_config(list(job))).path

    counts = {"launched": 0, "skipped": 0, "failed": 0}
    for branch in branches:
        cfg = compose_run_config(list(branch.job))
        ref = run_ref_from_config(cfg)
        if run_state(ref.path) == "completed":
            counts["skipped"] += 1
            continue
        origin = start_point(branch, run_dir)
        seed_checkpoint(branch, ref.path, to_plain_dict(validated_run_config(cfg)), origin)
        print(f"branch {branch.horizon} of {branch.trunk} from step {origin[1]} of {origin[0]} -> {ref.path}",
              file=sys.stderr)
        counts["launched"] += 1
        counts["failed"] += run(list(branch.job)) != 0
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m experiments.sweeps.branches", description=__doc__.split("\n")[0])
    parser.add_argument("sweep", help="sweep file (path or name under experiments/sweeps/) with a branches block")
    parser.add_argument("--list", action="store_true", help="print the branches and their state; launch nothing")
    parser.add_argument("overrides", nargs="*", help="added to every run, as on the experiments.run command line")
    args = parser.parse_args(argv)

    def go() -> int:
        branches = all_branches(args.sweep, args.overrides)
        if args.list:
            for b in branches:
                chained = "".join(f" (or step {step} of its {h}-step branch)" for h, step in b.via)
                print(f"{b.trunk} h={b.horizon} from step {b.start}{chained}: {' '.join(b.job)}")
            return 0
        counts = launch(branches)
        print(", ".join(f"{k} {v}" for k, v in counts.items()))
        return 1 if counts["failed"] else 0

    return one_line_errors(go, OSError)


if __name__ == "__main__":
    sys.exit(main())
