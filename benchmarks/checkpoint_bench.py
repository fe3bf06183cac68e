"""Checkpoint size per method for one model, and HMT's device bytes held by projection bases with and without the
host basis cache (``method.offload_bases``), with host↔device bytes per step.

    python benchmarks/checkpoint_bench.py [--model tiny|125m|...] [--steps 4] [--seq-len 128] [--batch 2]

Trains ``--steps`` steps of each method on random tokens (same init), writes one checkpoint with the run's own
code (``experiments.checkpoint.manager.Checkpointer``) and reports its files' sizes. Runs on CPU or CUDA (``--device``);
on CPU "device" and "host" are the same memory, so the cache's byte counts are bookkeeping, not savings.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from experiments import methods
from experiments.checkpoint.manager import Checkpointer, LoopState
from experiments.config import MODEL_PHASES
from experiments.loop import autocast_context, train_step
from experiments.models import build_model, count_params
from hmt_core.basis_cache import basis_bytes

METHODS = {
    "adamw": {"name": "adamw"},
    "hmt": {"name": "hmt", "update_interval": 2},
    "hmt+offload": {"name": "hmt", "update_interval": 2, "offload_bases": True},
    "galore": {"name": "galore", "update_proj_gap": 2},
}


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def run_one(name: str, raw: dict, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    cfg = MODEL_PHASES[args.model]
    model = build_model(cfg, device=device)
    if raw["name"] == "galore":
        raw = {**raw, "rank": min(128, cfg.hidden_size // 2)}
    method = methods.make_method(methods.make_config(dict(raw)))
    model = method.prepare(model)
    method.attach(model, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).to(device)
        train_step(model, method, [ids], meter=None, autocast=lambda: autocast_context(device, True))
    with tempfile.TemporaryDirectory() as tmp:
        saved = Checkpointer(Path(tmp), every=1, keep=1, model=model, method=method, meta={}).save(
            LoopState(next_step=args.steps))
    out = {"method": name, "params": count_params(model)[1], "bytes": saved.bytes_by_file, "total": saved.total_bytes,
           "seconds": saved.seconds}
    if raw["name"] == "hmt":
        out["bases_bytes"] = sum(basis_bytes(s.basis) for s in method.opt.slots)
        out["cache"] = method.cache_stats()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(MODEL_PHASES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = [run_one(name, METHODS[name], args, device) for name in args.methods.split(",")]
    print(f"model {args.model} ({rows[0]['params']:,} trainable params, bf16 weights), {args.steps} steps, "
          f"device {device.type}\n")
    print(f"{'method':<12} {'model.pt':>9} {'method.pt':>9} {'loop.pt':>9} {'total MiB':>9}  save s")
    for r in rows:
        b = r["bytes"]
        print(f"{r['method']:<12} {mib(b['model.pt'])} {mib(b['method.pt'])} {mib(b['loop.pt'])} {mib(r['total'])}"
              f"  {r['seconds']:.2f}")
    for r in rows:
        c = r.get("cache")
        if not c:
            continue
        steps = args.steps
        print(f"\n{r['method']}: bases {mib(r['bases_bytes'])} MiB in total; device bytes held by bases: "
              f"without cache {mib(c['cache/device_bytes_without_cache'])} MiB, with cache (peak) "
              f"{mib(c['cache/device_bytes_peak'])} MiB; per step: host→device {mib(c['cache/h2d_bytes'] / steps)} "
              f"MiB, device→host {mib(c['cache/d2h_bytes'] / steps)} MiB (refresh every 2 steps); hits "
              f"{c['cache/hits']:.0f}, misses {c['cache/misses']:.0f}")


if __name__ == "__main__":
    main()
