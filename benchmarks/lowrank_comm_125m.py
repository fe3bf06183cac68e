"""Gradient bytes per step under DDP at the real 125m phase (12 layers, hidden 768, vocab 32000), counted, side by
side: DDP adamw, per-layer hmt with the full all-reduce, and with ``dist.lowrank_comm`` (GaLore's projection
``R = Pᵀ G``, Zhao et al. 2024, Eq. 2, all-reduced instead of G, and the embedding's non-zero rows as a sparse
all-reduce), also with the LM head projected (``method.target_patterns`` + ``lm_head``: Ĝ = G Q is 32000 × r).

    python benchmarks/lowrank_comm_125m.py            # 2 gloo processes on CPU; writes results/lowrank_comm_125m/

Bytes are what ``experiments.dist.comm.CommCounter`` counts (the payload handed to each collective), for step 0
(every basis refreshed: projected gradients all-reduced in full) and step 1 (between refreshes); "amortized" spreads
one refresh over ``update_interval=200`` steps. The embedding's sparse payload depends on the distinct tokens per
rank: the batches are uniform random token ids (4 × 512 per rank), the pessimistic case — natural text repeats
tokens, so its batches touch fewer rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "results" / "lowrank_comm_125m"
MIB = 2**20
SETUPS = {  # name -> (method overrides, lowrank_comm)
    "adamw (DDP)": ({"name": "adamw"}, False),
    "hmt r64, full all-reduce": ({"name": "hmt", "rank": 64}, False),
    "hmt r64, lowrank_comm": ({"name": "hmt", "rank": 64}, True),
    "hmt r64 + lm_head, lowrank_comm": ({"name": "hmt", "rank": 64,
                                         "target_patterns": ["attn", "mlp", "lm_head"]}, True),
    "hmt default, lowrank_comm": ({"name": "hmt"}, True),
    "hmt default + lm_head, lowrank_comm": ({"name": "hmt", "target_patterns": ["attn", "mlp", "lm_head"]}, True),
}


def _setup(rank: int, world: int, name: str, data: list[torch.Tensor], counter) -> dict:
    from experiments import methods
    from experiments.dist import parallel as distributed
    from dataclasses import replace

    from experiments.config import MODEL_PHASES
    from experiments.dist.parallel import DistContext
    from experiments.loop import train_step
    from experiments.models import build_model

    overrides, lowrank = SETUPS[name]
    ctx = DistContext(mode="ddp", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                      device=torch.device("cpu"), lowrank_comm=lowrank, comm=counter)
    torch.manual_seed(0)
    model = build_model(replace(MODEL_PHASES["125m"], dtype="fp32"))
    overrides = dict(overrides)
    if overrides["name"] == "hmt":
        overrides.setdefault("update_interval", 200)
    method = methods.make_method(methods.make_config(overrides))
    method.attach(model, max_grad_norm=1.0)
    method.set_lr_scale(1.0)
    forward = distributed.wrap_for_forward(model, method, ctx)
    rows = data[0].shape[0] // world
    steps = []
    for x in data:
        before = counter.bytes["grad"]
        train_step(forward, method, [x[rank * rows:(rank + 1) * rows]], meter=None,
                   autocast=contextlib.nullcontext, skip_nonfinite=True)
        steps.append(counter.bytes["grad"] - before)
    metrics = method.metrics()
    return {"refresh_step_bytes": steps[0], "step_bytes": steps[1], "params": sum(p.numel() for p in
                                                                                 model.parameters()),
            "rank_mean": metrics.get("rank/mean"), "rank_max": metrics.get("rank/max"),
            "state_bytes": method.summary().get("optim/state_bytes")}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from experiments.dist.comm import CommCounter

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counter = CommCounter().install()
    try:
        gen = torch.Generator().manual_seed(7)
        data = [torch.randint(0, 32000, (4 * world, 512), generator=gen) for _ in range(2)]
        results = {}
        for name in SETUPS:
            results[name] = _setup(rank, world, name, data, counter)
            if rank == 0:
                print(f"{name}: {results[name]}", flush=True)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        counter.uninstall()
        dist.destroy_process_group()


def table(results: dict) -> str:
    base = results["adamw (DDP)"]["step_bytes"]
    lines = ["| setup | rank mean (max) | refresh step (MiB) | step (MiB) | step / adamw | amortized / adamw (K = 200) |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        amortized = (r["refresh_step_bytes"] + 199 * r["step_bytes"]) / 200
        ranks = "—" if r.get("rank_mean") is None else f"{r['rank_mean']:.0f} ({r['rank_max']:.0f})"
        lines.append(f"| {name} | {ranks} | {r['refresh_step_bytes'] / MIB:.2f} | {r['step_bytes'] / MIB:.2f} | "
                     f"{r['step_bytes'] / base:.4f} | {amortized / base:.4f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", action="store_true", help="print the table from results/lowrank_comm_125m/ only")
    args = ap.parse_args()
    if not args.table:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(2, port, tmp), nprocs=2, join=True)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
        OUT.mkdir(parents=True, exist_ok=True)
        record = {"model": "125m (12 layers, hidden 768, vocab 32000, fp32)", "world_size": 2,
                  "tokens_per_rank": 4 * 512, "tokens": "uniform random ids", "by_rank": ranks}
        (OUT / "bytes.json").write_text(json.dumps(record, indent=2) + "\n")
    record = json.loads((OUT / "bytes.json").read_text())
    print(table(record["by_rank"][0]))


if __name__ == "__main__":
    main()
