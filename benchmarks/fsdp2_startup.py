"""FSDP2's start-up peak per rank, two ways, on CPU with gloo (``experiments.memory.meter.StartupPeak``, live tensor bytes):
the meta start (``experiments.dist.parallel.build_sharded``: meta build, ``fully_shard``, ``to_empty``, the
single-process values replayed shard by shard, ``experiments.dist.meta_init``) and the old start (the whole model built on
the device, then ``fully_shard``), for a random-init Llama of the given shape, W processes, and the wall time of each
(metered: the meter's dispatch overhead is in both; a tiny model is started first as a warm-up).

    OMP_NUM_THREADS=1 python benchmarks/fsdp2_startup.py --hidden 1024 --layers 8 --intermediate 2816 --vocab 32000

Prints one JSON line per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Identity:
    def prepare(self, model, *, device=None, materialize=None):
        return model


def _worker(rank: int, world: int, port: int, shape: dict) -> None:
    import torch.distributed as dist

    from experiments.dist import parallel as distributed
    from experiments.config import ModelConfig
    from experiments.memory.meter import StartupPeak
    from experiments.models import build_model

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = distributed.DistContext(mode="fsdp2", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                                      device=torch.device("cpu"))
        out = {"rank": rank, "world_size": world, **shape}
        warm_up = ModelConfig(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)
        for cfg in (warm_up, ModelConfig(**shape)):
            for name, start in (("meta", lambda: distributed.build_sharded(cfg, _Identity(), ctx, vocab_size=None,
                                                                           device=ctx.device)),
                                ("old", lambda: distributed.shard_model(build_model(cfg, device=ctx.device), ctx))):
                torch.manual_seed(0)  # (the first, tiny model: a warm-up, its figures overwritten)
                t0 = time.perf_counter()
                with StartupPeak(ctx.device) as peak:
                    model = start()
                out[f"{name}_startup_peak_bytes"], out[f"{name}_time_s"] = peak.peak_bytes, time.perf_counter() - t0
                del model
        out["params_bytes"] = sum(p.numel() * p.element_size() for p in build_model(cfg, device="meta").parameters())
        out["largest_param_bytes"] = max(p.numel() * p.element_size()
                                         for p in build_model(cfg, device="meta").parameters())
        print(json.dumps(out), flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bf16")
    a = ap.parse_args()
    shape = dict(hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads, intermediate_size=a.intermediate,
                 vocab_size=a.vocab, dtype=a.dtype)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(a.world, port, shape), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
