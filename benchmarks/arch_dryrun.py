"""Dry-run memory of one 7B-class training step across architectures built from their ``config.json``.

    python benchmarks/arch_dryrun.py [--archs llama2-7b,...] [--methods adamw,...] [--seq-len 2048] [--batch 1]
                                     [--out results/arch_dryrun] [--force]

Writes the published configs of Llama-2-7B, Mistral-7B-v0.1 and Qwen2-7B, and a GPT-2 scaled to ~7B (``Conv1D``
layers), as config-only model directories under ``<out>/configs/``, then runs

    python -m experiments.run mode=dryrun model.path=<out>/configs/<arch> method=<method> [settings]
        train.seq_len=2048 train.batch_size=1 results_dir=<out> run_id=<arch>-<method>

for every (architecture, method) as its own process (``FakeTensorMode``: no GPU, no weights, ~20–60 s each on a
small CPU), collects each ``summary.json``'s ``memory.peak_bytes`` and ``memory.peak_by_category_bytes`` (the
categories at the step's peak), prints an architecture × method table in GiB and writes ``<out>/table.md``.
A run already completed in ``<out>`` is read back, not re-run, unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
CATEGORIES = ("params", "grads", "optimizer", "activations", "temp", "other")

ARCHS: dict[str, dict] = {
    "llama2-7b": {  # meta-llama/Llama-2-7b-hf
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "mistral-7b": {  # mistralai/Mistral-7B-v0.1
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2},
    "qwen2-7b": {  # Qwen/Qwen2-7B
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 131072, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 28, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151643},
    "gpt2-7b": {  # GPT-2 layout (Conv1D, learned positions, tied embeddings) scaled to ~7B; dropout off like the
        # others (GPT-2's published 0.1 makes SDPA fall back to the math kernel on CPU: the (S, S) weights appear)
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 4096, "n_layer": 32, "n_head": 32,
        "n_positions": 2048, "vocab_size": 50257, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "bos_token_id": 50256, "eos_token_id": 50256},
}

METHODS: dict[str, list[str]] = {
    "adamw": ["method=adamw"],
    "galore": ["method=galore"],
    "apollo": ["method=apollo", "method.variant=apollo"],
    "apollo-mini": ["method=apollo", "method.variant=mini"],
    "hmt": ["method=hmt"],
}

# (architecture, method) -> (extra settings, why): where a method's default does not fit the architecture
OVERRIDES: dict[tuple[str, str], tuple[list[str], str]] = {
    ("qwen2-7b", "apollo"): (["method.rank=512"], "APOLLO's rank d/4 = 896 exceeds Qwen2-7B's 512-row k_proj/v_proj "
                             "(4 KV heads × 128), so rank 512 = the largest that fits every projected weight"),
}


def write_configs(out: Path, archs: list[str]) -> dict[str, Path]:
    """One config-only model directory per architecture."""
    dirs = {}
    for arch in archs:
        path = out / "configs" / arch
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(ARCHS[arch], indent=2) + "\n")
        dirs[arch] = path
    return dirs


def run_dryrun(overrides: list[str], out: Path, run_id: str, *, timeout: int, force: bool) -> dict:
    """``python -m experiments.run mode=dryrun <overrides>`` in its own process, writing ``<out>/<run_id>``; the
    summary's peak and categories at it, or ``error`` (the last line it printed)."""
    summary_path = out / run_id / "summary.json"
    cmd = [sys.executable, "-m", "experiments.run", "mode=dryrun", *overrides, f"results_dir={out.resolve()}",
           f"run_id={run_id}", *(["force=true"] if force else [])]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not summary_path.exists():
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": last, "wall_s": wall}
    summary = json.loads(summary_path.read_text())
    mem = summary["memory"]
    return {"peak_bytes": mem["peak_bytes"], "by_category": mem["peak_by_category_bytes"],
            "params_total": summary["params_total"],
            "projected_params": (summary.get("method_summary") or {}).get("projected_params"),
            "trace_s": summary["dryrun"]["wall_s"], "wall_s": wall}


def run_one(arch: str, method: str, model_dir: Path, args) -> dict:
    """Dry-run one (architecture, method) in its own process; returns the row for the table."""
    overrides = [f"model.path={model_dir.resolve()}", *METHODS[method], *OVERRIDES.get((arch, method), ([], ""))[0],
                 f"train.seq_len={args.seq_len}", f"train.batch_size={args.batch}"]
    row = run_dryrun(overrides, args.out, f"{arch}-{method}", timeout=args.timeout, force=args.force)
    return {"arch": arch, "method": method, **row}


def gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f}"


def billions(n: int | None) -> str:
    return "—" if not n else f"{n / 1e9:.2f} B"


def render(rows: list[dict], archs: list[str], methods: list[str], args) -> str:
    """Markdown: peak GiB per architecture × method, then every run's categories at its peak."""
    by_key = {(r["arch"], r["method"]): r for r in rows}
    lines = [f"Dry-run peak memory (GiB) of one training step, seq {args.seq_len}, batch {args.batch}, BF16 weights, "
             "method defaults, `activation=none`, clipping 1.0:", "",
             "| architecture | params | " + " | ".join(methods) + " |",
             "|---|---:|" + "---:|" * len(methods)]
    for arch in archs:
        params = next((r["params_total"] for r in rows if r["arch"] == arch and "params_total" in r), None)
        cells = ["failed" if "error" in by_key[(arch, m)] else gib(by_key[(arch, m)]["peak_bytes"])
                 + ("*" if (arch, m) in OVERRIDES else "") for m in methods]
        lines.append(f"| {arch} | {billions(params)} | " + " | ".join(cells) + " |")
    notes = [f"\\* {arch} {m} with `{' '.join(extra)}`: {why}." for (arch, m), (extra, why) in OVERRIDES.items()
             if arch in archs and m in methods]
    lines += ["", *notes] if notes else []
    lines += ["", "At each run's peak (GiB):", "",
              "| architecture | method | peak | " + " | ".join(CATEGORIES) + " | projected params | traced in (s) |",
              "|---|---|---:|" + "---:|" * len(CATEGORIES) + "---:|---:|"]
    for arch in archs:
        for m in methods:
            r = by_key[(arch, m)]
            if "error" in r:
                lines.append(f"| {arch} | {m} | failed: {r['error']} |" + " |" * (len(CATEGORIES) + 2))
                continue
            cats = " | ".join(gib(r["by_category"].get(c)) for c in CATEGORIES)
            lines.append(f"| {arch} | {m} | {gib(r['peak_bytes'])} | {cats} | {billions(r['projected_params'])} | "
                         f"{r['trace_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated, of: " + ", ".join(ARCHS))
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "arch_dryrun")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per dry run")
    parser.add_argument("--force", action="store_true", help="re-run dry runs already completed in --out")
    args = parser.parse_args()
    archs, methods = args.archs.split(","), args.methods.split(",")
    for name, known in ((archs, ARCHS), (methods, METHODS)):
        unknown = [x for x in name if x not in known]
        if unknown:
            parser.error(f"unknown {unknown}; choose from {list(known)}")
    dirs = write_configs(args.out, archs)
    rows = []
    for arch in archs:
        for method in methods:
            row = run_one(arch, method, dirs[arch], args)
            rows.append(row)
            status = row.get("error") or f"peak {gib(row['peak_bytes'])} GiB"
            print(f"{arch:<11} {method:<12} {status}  ({row['wall_s']:.0f} s)", flush=True)
    table = render(rows, archs, methods, args)
    (args.out / "table.md").write_text(table)
    print()
    print(table)


if __name__ == "__main__":
    main()
