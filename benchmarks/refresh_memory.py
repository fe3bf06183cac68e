"""Per-rank memory of one basis refresh of one weight under FSDP2, ``dist.refresh=gather`` vs ``sketch``, at rank 0
of W (PyTorch's fake process group + ``FakeTensorMode``, bf16 weights, hmt's defaults: rank candidates up to 256,
oversample 8, 2 power iterations). ``gather``: all-gather G (m × n, what ``DTensor.full_tensor`` returns), the
single-process refresh, a left-sided Ĝ from the gathered G; ``sketch``: the distributed randomized SVD on the row
shard (``hmt_core.optim.sharded_sketch``; Halko et al. 2011, Alg. 4.4). Peak live bytes above the gradient shard
(temporaries + the new state), measured by ``experiments.memory.meter.MemoryMeter``.

    python benchmarks/refresh_memory.py      # writes results/refresh_memory/refresh.json and prints the table
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "results" / "refresh_memory"
GIB = 2**30
SHAPES = {"70b gate/up_proj (right)": (28672, 8192), "70b down_proj (left)": (8192, 28672),
          "70b q/o_proj (right)": (8192, 8192), "13b gate/up_proj (right)": (13824, 5120),
          "13b down_proj (left)": (5120, 13824)}
WORLDS = (8, 64)


def refresh_bytes(m: int, n: int, world: int, mode: str) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from experiments import methods
    from experiments.memory.meter import MemoryMeter
    from hmt_core.kernels import ops as kops
    from hmt_core.hmt_config import optimizer_settings
    from hmt_core.optim.optimizer import LowRankOptimizer, Slot
    from hmt_core.optim.slot import ShardRows
    from hmt_core.optim.rows import rank_rows
    from hmt_core.optim.sharded_sketch import RowSketch

    cfg = methods.make_config({"name": "hmt"})
    with FakeTensorMode():
        rows = rank_rows(m, world, 0)
        local = torch.empty(rows.stop - rows.start, n, dtype=torch.bfloat16)
        param = torch.empty_like(local)
        s = Slot(name="w", param=param, index=1, projected=True, candidates=cfg.rank_candidates,
                 shard=ShardRows(rows=rows, global_shape=(m, n), grad_param=param))
        opt = LowRankOptimizer([s], optimizer_settings(cfg))
        meter = MemoryMeter(source="fake")
        meter.track([local, param], "params")
        with meter, meter.phase("optimizer"):
            if mode == "gather":
                full = local.new_empty((m, n))  # the all-gather's output
                opt.refresh(s, full)
                low = kops.project(full, s.basis) if s.basis.left is not None else None
                del full
            else:
                sketch = RowSketch(local, rows=rows, shape=(m, n), group=dist.group.WORLD)
                opt.refresh(s, None, sketch=sketch)
                low = sketch.low
            low = kops.project(local, s.local_basis()) if low is None else low
            del low
        peak = meter.report().peak_by_category_bytes
    return peak.get("temp", 0) + peak.get("optimizer", 0)


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rows = []
    for world in WORLDS:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            for label, (m, n) in SHAPES.items():
                row = {"weight": label, "shape": [m, n], "world_size": world,
                       **{f"{mode}_bytes": refresh_bytes(m, n, world, mode) for mode in ("gather", "sketch")}}
                rows.append(row)
                print(f"{label} W={world}: gather {row['gather_bytes'] / GIB:.3f} GiB, "
                      f"sketch {row['sketch_bytes'] / GIB:.3f} GiB", flush=True)
        finally:
            dist.destroy_process_group()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "refresh.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| weight (m × n) | W | gather (GiB) | sketch (GiB) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['weight']} {r['shape'][0]} × {r['shape'][1]} | {r['world_size']} | "
              f"{r['gather_bytes'] / GIB:.3f} | {r['sketch_bytes'] / GIB:.3f} |")


if __name__ == "__main__":
    main()
