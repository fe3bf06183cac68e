"""Row-sparse embedding updates under DDP (2 processes, gloo): per-layer HMT with ``method.embedding_update`` gathers
every rank's (token ids, output-gradient rows) — the rows travel as rows, never a (V, d) gradient — and one step at
a time from the single-process state the weights equal the single-process global batch's.

Why not bit for bit: the single-process reference looks the embedding up twice (one forward per half-batch, one
backward), and autograd runs the second lookup's backward first, so a row's token gradients are summed in another
order than the ranks' concatenation (rank 0's tokens, then rank 1's); the embedding's norm then enters the clipping
coefficient of every weight. Tolerance: 1e-5 of the weights' scale — the order of a few fp32 additions per row
(2⁻²⁴ relative each) amplified by Adam's normalization of small gradient entries; every tensor's worst difference is
printed on failure.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_distributed import _diffs, _method, _reference, micro_rows, spawn_pair  # noqa: E402

STEPS = 3
CASES = {
    "A-lazy_exact": {"name": "hmt", "rank": 8, "update_interval": 2, "embedding_update": "lazy_exact",
                     "weight_decay": 0.01},
    "B-sparse_adam": {"name": "hmt", "mode": "B", "rank": 8, "update_interval": 2, "embedding_update": "sparse_adam"},
    # the INT8 embedding by rows with 8-bit row moments: requantized by stochastic rounding from the same seeded draws
    "A-int8-lazy_exact": {"name": "hmt", "rank": 8, "update_interval": 2, "embedding_update": "lazy_exact",
                          "embedding_dtype": "int8", "dense_8bit": True, "weight_decay": 0.01},
}


def _case(rank: int, overrides: dict, data, snaps) -> dict:
    from experiments.dist import parallel as distributed
    from experiments.dist.parallel import DistContext
    from experiments.loop import train_step
    from helpers import tiny_llama

    ctx = DistContext(mode="ddp", rank=rank, world_size=2, local_rank=rank, backend="gloo",
                      device=torch.device("cpu"))
    model = tiny_llama(seed=1)
    method = _method("hmt", overrides, model)
    forward = distributed.wrap_for_forward(model, method, ctx)
    gathered = []
    rows = method.engine.reduce_grad.rows

    def record(ids, values):
        all_ids, all_values = rows(ids, values)
        gathered.append([list(ids.shape), list(values.shape), list(all_ids.shape), list(all_values.shape)])
        return all_ids, all_values

    method.engine.reduce_grad.rows = record
    out = {"diffs": [], "grads": []}
    for x, snap in zip(data, snaps):
        model.load_state_dict(snap["weights"])
        method.load_state_dict(torch.load(io.BytesIO(snap["method"]), weights_only=False))
        batch = [x[micro_rows(rank, 2, x.shape[0] // 2, 1)[0]]]
        train_step(forward, method, batch, meter=None, autocast=contextlib.nullcontext, skip_nonfinite=True)
        out["grads"].append(model.model.embed_tokens.weight.grad is None)
        out["diffs"].append(_diffs(model.state_dict(), snap["after"]))
        out["scale"] = max(v.abs().max().item() for v in snap["after"].values())
    out["gathered"] = gathered
    return out


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from helpers import join_gloo, seeded_token_batches

    join_gloo(rank, world, port, timeout_s=60)
    try:
        data = seeded_token_batches(STEPS)
        results = {case: _case(rank, o, data, _reference("hmt", o, data)) for case, o in CASES.items()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("dist_rows"))


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_row_sparse_embedding_equals_the_single_process_global_batch(spawned, case):
    for rank, res in spawned.items():
        r = res[case]
        # 4 × 16 global tokens, hidden 64: each rank hands over its 2 × 16 ids and rows, and gets both ranks' 64
        assert r["gathered"] == [[[32], [32, 64], [64], [64, 64]]] * STEPS, r["gathered"]
        assert all(r["grads"]), "the embedding got a dense .grad"
        for step, diffs in enumerate(r["diffs"]):
            # the INT8 table: a row's tokens are summed in the same order both ways (forward order, rank by rank),
            # so the fp32 values and hence the stochastic rounding's codes agree: bit for bit
            tol = 0.0 if "int8" in case else 1e-5 * r["scale"]
            bad = {k: d for k, (d, m) in diffs.items() if d > tol}
            table = "\n".join(f"  {k}: max|diff| {d:.3e} (max|expected| {m:.3e})" for k, (d, m) in diffs.items())
            assert not bad, f"{case}, rank {rank}, step {step}: weights differ from the reference:\n{table}"
