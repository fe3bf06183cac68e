"""Does the planner's answer learn at the size it was planned for? Each model family's plan, trained on a CPU proxy
of its shape (the card's full width and vocabulary, ``--layers`` decoder layers), against AdamW and HMT defaults
at equal tokens.

    python -m benchmarks.plan_learns [--families llama3,qwen2.5,mistral,gemma2,llama2,llama3-streamed] [--layers 1]
                                     [--steps 10] [--seq 256] [--batch 2] [--out-dir results/plan_learns]

Per family: the planner answers for the card at its budget (``python -m experiments.plan model=<card>
train.seq_len=2048 budget_gib=<g>``, a fresh folder, the committed cost table); the plan it writes is then trained
as written (``+plans=<name>``: its optimizer setting, vocabulary settings, activation actions, learning rate) with
``model.path`` a copy of the card's config.json cut to ``--layers`` layers, ``--steps`` steps of ``--batch`` ×
``--seq`` tokens with the plan's warm-up fraction of them (10 % of 10 steps: one step, so nine steps run at the
plan's full rate: on a GPU the 8B plan's loss had jumped 12.57 → 20.99 after its first update); AdamW
(``method=adamw``) and HMT defaults (``method=hmt``) train the same proxy on the same batches and the same
schedule. A plan **passes** when no step after step 0 has a training loss more than ``NOISE_NATS`` above its
step-0 loss (one batch's loss is noisy) and its last-step loss is within ``DELTA`` nats of HMT default's (``--rejudge``: apply the rule to the files already written,
training nothing). Every run's
per-step losses are kept in ``<out-dir>/<family>.json`` (written atomically when the family's three runs are done;
a failed answer's row moves to ``<family>-failed-<k>.json`` when the planner's next answer is checked);
a rerun skips the families already judged at the same settings for the answer the planner gives today, and
where only the answer changed (or the plan's run gave no verdict) retrains the plan alone (the AdamW and
HMT-default runs do not depend on it).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from experiments.planner.recipe import RATE_KEYS
from experiments.results import atomic_write_text

REPO = Path(__file__).resolve().parent.parent
CARDS = REPO / "experiments" / "model_cards"
SCHEMA = "hmt-plan-learns/1"
# nats a single batch's training loss may sit above step 0's before it counts: the untrained 8B proxy's loss on the
# first 10 batches has a spread of 0.036 (std) and its largest is 0.061 above the first batch's (measured with the
# proxy at init, bf16); 0.1 is about three of those spreads
NOISE_NATS = 0.1
DELTA = 0.5  # nats: the last-step loss a plan may lose against HMT default's (the campaign's memory-minimal row
# lost 0.87 nats to HMT default on `tiny` after 300 steps; a plan is allowed a bit over half of that at 10 steps)
# family -> (model card, budget GiB); the Llama-2 shape is the named `7b` model (experiments.model_config)
FAMILIES = {"llama3": ("llama3.1-8b", 16), "qwen2.5": ("qwen2.5-7b", 16), "mistral": ("mistral-7b-v0.3", 16),
            "gemma2": ("gemma2-9b", 24), "llama2": ("7b", 16), "llama3-streamed": ("llama3.1-8b", 12)}
# planner keys a family's answer is asked with: the streamed family is the 12 GiB card only weight streaming fits
PLANNER_KEYS = {"llama3-streamed": ["weight_offloads=[none,host]"]}
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def proxy_dir(card: str, layers: int, scratch: Path) -> Path:
    """A folder holding the card's config.json with ``layers`` decoder layers (no tokenizer: a BPE is trained at
    the card's vocabulary)."""
    config = LLAMA2_7B if card == "7b" else json.loads((CARDS / card / "config.json").read_text())
    config = {**config, "num_hidden_layers": layers}
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:layers]
    out = scratch / f"proxy-{card}-{layers}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def plan_for(card: str, budget: int, scratch: Path, keys: list[str] = ()) -> tuple[Path, dict]:
    """The planner's answer (asked with the planner ``keys``): (the plan's yaml, its record)."""
    results = scratch / f"plan-{card}-{budget}"
    cmd = [sys.executable, "-m", "experiments.plan", f"model={card}", "train.seq_len=2048", f"budget_gib={budget}",
           f"results_dir={results}", *keys]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"planner failed for {card}@{budget} GiB: {proc.stderr.strip().splitlines()[-1:]}")
    record = sorted((results / "plans").glob("*.json"))[-1]
    return record.with_suffix(".yaml"), json.loads(record.read_text())


def train(label: str, overrides: list[str], proxy: Path, args, scratch: Path) -> dict:
    """One CPU run of the proxy; its per-step training losses read from metrics.jsonl."""
    results = scratch / f"runs-{label}"
    cmd = [sys.executable, "-m", "experiments.run", "model.card=null", f"model.path={proxy}", "device=cpu",
           f"train.seq_len={args.seq}", f"train.batch_size={args.batch}", f"train.steps={args.steps}",
           "train.log_every=1", f"train.eval_every={args.steps}", "train.eval_batches=1", "train.progress=false",
           "train.confirm=true", f"results_dir={results}", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    row = {"label": label, "overrides": overrides, "returncode": proc.returncode,
           "wall_s": round(time.perf_counter() - start, 1)}
    metrics = sorted(results.glob("*/metrics.jsonl"))
    if not metrics:
        return {**row, "error": (proc.stderr.strip().splitlines() or ["(no output)"])[-1]}
    losses = [json.loads(line).get("loss/train") for line in metrics[-1].read_text().splitlines()]
    return {**row, "losses": [x for x in losses if x is not None]}


def verdict(plan: dict, default: dict) -> dict:
    """The pass rule of the module docstring, with its two numbers."""
    losses = plan.get("losses") or []
    if not losses or not default.get("losses"):  # the proxy could not run (out of memory, ...): no verdict
        failed = plan if not losses else default
        return {"passes": None, "why": f"not judged: {failed['label']} logged no step (rc {failed['returncode']}"
                                       f"{', killed: out of memory' if failed['returncode'] == -9 else ''})"}
    after = losses[1:]
    worst = max(after) if after else -math.inf
    gap = losses[-1] - default["losses"][-1]
    passes = worst <= losses[0] + NOISE_NATS and gap <= DELTA and all(math.isfinite(x) for x in losses)
    return {"passes": passes, "max_loss_after_step0": worst, "step0_loss": losses[0], "gap_to_hmt_default": gap}


def reusable(previous: dict | None, label: str, overrides: list[str]) -> dict | None:
    """A reference run (AdamW, HMT default) of an earlier file at the same settings, when its overrides are the
    ones it would run with now: the references do not depend on the planner's answer, so a re-planned family
    retrains only its plan."""
    for run in (previous or {}).get("runs", []):
        same = run.get("label") == label or run.get("label", "").split("-")[-1] == label.split("-")[-1]
        if same and run.get("overrides") == overrides and run.get("losses"):
            return run
    return None


def same_card_rows(out_dir: Path, family: str, settings: dict) -> list[dict]:
    """The rows of other families on the same card at the same settings: their AdamW and HMT-default runs train the
    same proxy on the same batches (a streamed family reuses its resident family's)."""
    card = FAMILIES[family][0]
    docs = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json")) if not p.name.startswith("archive-")]
    return [d["row"] for d in docs if d.get("settings") == settings and d["row"].get("card") == card]


def family_row(family: str, answer: tuple[Path, dict], args, scratch: Path, previous: dict | None = None) -> dict:
    """The family's three runs (the plan ``answer``: its yaml and record; AdamW and HMT default taken from
    ``previous``, the family's earlier row, where ``reusable``) and the verdict."""
    card, budget = FAMILIES[family]
    plan_yaml, record = answer
    proxy = proxy_dir(card, args.layers, scratch)
    nodes = yaml.safe_load(plan_yaml.read_text())
    plan_train = nodes["train"]
    warmup = max(1, round(plan_train["warmup_steps"] / plan_train["steps"] * args.steps))  # the plan's fraction
    attn = nodes["model"].get("attn_implementation", "sdpa")  # Gemma 2's card: eager (transformers has no SDPA)
    common = [f"train.warmup_steps={warmup}", *([f"model.attn_implementation={attn}"] if attn != "sdpa" else [])]
    plan_run = train(f"{family}-plan", [f"hydra.searchpath=[file://{plan_yaml.parent.parent}]",
                                        f"+plans={plan_yaml.stem}", *common], proxy, args, scratch)
    rows = [previous, *(getattr(args, "same_card", None) or [])]
    adamw, default = (next((r for row in rows if (r := reusable(row, f"{family}-{name}", [f"method={name}", *common]))),
                           None) or train(f"{family}-{name}", [f"method={name}", *common], proxy, args, scratch)
                      for name in ("adamw", "hmt"))
    return {"family": family, "card": card, "budget_gib": budget, "plan": record.get("choice", {}),
            "plan_label": record["choice"]["optimizer_label"], "plan_lr": nodes["method"]["lr"],
            **{f"plan_{key}": nodes["method"].get(key, 1.0) for key in RATE_KEYS if key != "lr"},
            "warmup_steps": warmup, "runs": [plan_run, adamw, default],
            **verdict(plan_run, default)}


def rejudge(out_dir: Path) -> int:
    """The verdicts of ``out_dir``'s family files, recomputed with this module's rule (atomically rewritten)."""
    for path in sorted(out_dir.glob("*.json")):
        if path.name.startswith("archive-"):
            continue
        doc = json.loads(path.read_text())
        plan, _, default = doc["row"]["runs"]
        for key in ("passes", "why", "max_loss_after_step0", "step0_loss", "gap_to_hmt_default"):
            doc["row"].pop(key, None)
        doc["row"].update(verdict(plan, default))
        doc.update(noise_nats=NOISE_NATS, delta_nats=DELTA)
        atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
        print(f"{path.name}: passes={doc['row']['passes']}")
    return 0


def failed_path(out_dir: Path, family: str) -> Path:
    """Where a family's failed row goes when its next answer is checked (``<family>-failed-<k>.json``): a verdict
    the planner still reads, so the failed setting stays not offered."""
    k = 1 + len(list(out_dir.glob(f"{family}-failed-*.json")))
    return out_dir / f"{family}-failed-{k}.json"


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out-dir", default=str(REPO / "results" / "plan_learns"))
    ap.add_argument("--rejudge", action="store_true", help="recompute the verdicts of the files in --out-dir")
    args = ap.parse_args(argv)
    if args.rejudge:
        return rejudge(Path(args.out_dir))
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        print(f"error: --families: unknown {unknown[0]} (known: {', '.join(FAMILIES)})", file=sys.stderr)
        return 2
    if args.seq * args.batch < 512:
        print(f"error: --seq × --batch = {args.seq * args.batch} tokens; the head's jump needs ≥ 512 a step",
              file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    settings = {"layers": args.layers, "steps": args.steps, "seq_len": args.seq, "batch_size": args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            out = out_dir / f"{family}.json"
            previous = json.loads(out.read_text()) if out.exists() else {}
            if previous.get("settings") != settings:
                previous = {}
            t0 = time.perf_counter()
            answer = plan_for(*FAMILIES[family], Path(tmp), PLANNER_KEYS.get(family, []))
            args.same_card = same_card_rows(out_dir, family, settings)
            judged = previous and previous["row"].get("passes") is not None  # a run with no verdict is retried
            method = yaml.safe_load(answer[0].read_text())["method"]
            row = previous.get("row", {})
            if judged and row.get("plan") == answer[1].get("choice", {}) and all(
                    row.get(f"plan_{key}", 1.0) == method.get(key, 1.0) for key in RATE_KEYS):
                continue  # measured at these settings for the answer the planner gives today
            if judged and row.get("passes") is False:  # the planner's next answer: the failed one's verdict is kept,
                atomic_write_text(failed_path(out_dir, family), json.dumps(previous, indent=1) + "\n")  # not offered
            r = {**family_row(family, answer, args, Path(tmp), previous.get("row")),
                 "wall_s": round(time.perf_counter() - t0, 1)}
            print(f"{family:8s} {r['card']:16s} passes={r['passes']}  " + "  ".join(
                f"{run['label']}: {' '.join(f'{x:.2f}' for x in run.get('losses', []))}" for run in r["runs"]),
                flush=True)
            out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out, json.dumps({"schema": SCHEMA, "settings": settings, "delta_nats": DELTA,
                                               "noise_nats": NOISE_NATS,
                                               "commit": commit(), "row": r}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
