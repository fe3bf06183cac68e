"""The learning check's verdict on a plan (``benchmarks.plan_learns`` writes ``results/plan_learns/<family>.json``:
the family's answer trained on a CPU proxy of its shape against AdamW and HMT defaults). A plan whose model, budget,
optimizer setting and rate match a checked row carries that row's verdict; a setting that failed is not offered
(``experiments.planner.plan`` solves again without it), and a plan never checked says so."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

LEARNS_DIR = Path(__file__).resolve().parents[2] / "results" / "plan_learns"


def learning_check(model: str, budget_gib: float, optimizer_label: str, rates: Mapping[str, float],
                   folder: Path | None = None) -> dict:
    """{"checked": False} or the matching row's {"checked", "passes", "file", "gap_to_hmt_default", ...}: the row of
    this model, budget and setting trained at ``rates`` (``experiments.planner.recipe.RATE_KEYS``: a row's
    ``plan_<key>``, a scale 1.0 where a row predates it); ``folder``: the results, by default ``LEARNS_DIR``."""
    folder = LEARNS_DIR if folder is None else folder
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        if path.name.startswith("archive-"):
            continue
        row = json.loads(path.read_text()).get("row", {})
        if (row.get("card"), row.get("budget_gib"), row.get("plan_label")) == (model, budget_gib, optimizer_label) \
                and row.get("plan_lr") is not None and all(
                    abs(row.get(f"plan_{key}", 1.0) - value) <= 1e-9 * value for key, value in rates.items()):
            if row.get("passes") is None:  # the proxy could not run the plan: no verdict either way
                return {"checked": False, "why": row.get("why", "not judged")}
            return {"checked": True, "passes": bool(row["passes"]), "file": f"results/plan_learns/{path.name}",
                    "gap_to_hmt_default": row.get("gap_to_hmt_default"),
                    "max_loss_after_step0": row.get("max_loss_after_step0"), "step0_loss": row.get("step0_loss")}
    return {"checked": False}


def describe(check: dict) -> str:
    """The plan table's row."""
    if not check.get("checked"):
        return ("not checked (python -m benchmarks.plan_learns trains a family's answer on a CPU proxy of its shape)"
                + (f"; {check['why']}" if check.get("why") else ""))
    gap = check.get("gap_to_hmt_default")
    verdict = "passed" if check["passes"] else "FAILED"
    return (f"{verdict} on a CPU proxy ({check['file']}: last loss {gap:+.2f} nats vs HMT default"
            + ("" if check["passes"] else f", a step at {check['max_loss_after_step0']:.2f} against step 0's "
               f"{check['step0_loss']:.2f}") + ")")
