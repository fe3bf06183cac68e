"""HMT's sharded engine (``hmt_core.optim.sharded``, FSDP2, 2 processes with gloo) waits for no device value on a
step that is not a basis refresh (``experiments.dispatch_counter``), Mode A (every finite decision from the
all-reduced global norm), Mode B rank 1 (the per-layer ‖G‖² all-reduce feeds the device flag) and the embedding
updated by rows, BF16 and INT8 (gathered rows, segment sums and the row step on the device); and a non-finite
gradient on one rank only skips the step on both ranks, on the device: the weights stay as they were, the norm is
NaN everywhere. The model's own forward syncs once (transformers' packed-sequence check): not HMT's, left out.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_distributed import spawn_pair  # noqa: E402
from test_fsdp2_rows import _built  # noqa: E402

CASES = {"mode_a": {"rank": 8, "update_interval": 100},
         "mode_b_rank1": {"mode": "B", "rank": 1, "basis": "random", "scaling": "tensor", "scale": 128,
                          "update_interval": 100},
         # the embedding left whole on every rank, its rows gathered (and an INT8 head's gradient all-reduced) by
         # hmt's reducer (tests/test_fsdp2_rows.py)
         "rows_lazy_exact": {"rank": 8, "update_interval": 100, "embedding_update": "lazy_exact"},
         "int8_rows": {"rank": 8, "update_interval": 100, "embedding_update": "sparse_adam",
                       "embedding_dtype": "int8"}}


def _step(model, method, ids, nan: bool):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    if nan:  # this rank's gradients only (the other rank's stay finite)
        loss = loss * math.nan
    loss.backward()
    norm = method.step()
    method.zero_grad()
    return norm


def _case(ctx, overrides: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from experiments.dispatch_counter import DispatchCounter

    model, method = _built(ctx, overrides, seed=1)  # prepared, sharded, attached, hmt's parallel context
    gen = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(3)]
    _step(model, method, data[0], nan=False)  # step 0: the refresh (gathers and reads on the host by design)
    counter = DispatchCounter()
    with counter:
        norm = _step(model, method, data[1], nan=False)
    full = StateDictOptions(full_state_dict=True)
    before = get_model_state_dict(model, options=full)
    norm_bad = _step(model, method, data[2], nan=ctx.rank == 1)
    after = get_model_state_dict(model, options=full)
    report = counter.report()
    return {"syncs": {k: n for k, n in report.sync_sites.items() if "<- transformers/" not in k},
            "all_syncs": report.sync_sites, "collectives": len(report.collectives),
            "norm": float(norm), "norm_bad": float(norm_bad),
            "changed": [k for k in before if not torch.equal(before[k], after[k])]}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from experiments.dist.parallel import DistContext

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = DistContext(mode="fsdp2", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                          device=torch.device("cpu"))
        results = {case: _case(ctx, overrides) for case, overrides in CASES.items()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("fsdp2_syncs"))


@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_hmt_step_has_no_host_sync_and_skips_a_nonfinite_step_on_every_rank(runs, case):
    for rank, results in runs.items():
        r = results[case]
        assert not r["syncs"], f"{case}, rank {rank}: {r['all_syncs']}"
        assert math.isfinite(r["norm"]) and r["norm"] > 0, r
        assert math.isnan(r["norm_bad"]), f"{case}, rank {rank}: the step with rank 1's NaN gradient returned {r}"
        assert not r["changed"], f"{case}, rank {rank}: a skipped step changed {r['changed']}"
