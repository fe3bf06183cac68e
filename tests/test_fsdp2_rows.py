"""Row-sparse and INT8 embeddings under FSDP2 (2 processes, gloo, CPU): the input embedding (and an INT8 LM head) is
left out of FSDP2's shards (``fully_shard(ignored_params=...)``, ``experiments.dist.parallel.shard_model``), whole
on every rank; its touched rows are gathered as (ids, rows) by the same ``GradAverager.rows`` as under DDP, an INT8
head's dense gradient averaged by the same reducer.

1. One step at a time from the single-process state, fsdp2 + hmt with ``method.embedding_update=lazy_exact`` (BF16
   and INT8 tables, the INT8 head dense or projected in Mode A) and ``sparse_adam`` (Mode B), and with dense INT8
   tables (the head projected, Mode B), equals single-process hmt on the global batch, 3 steps, clipping on; three
   of them with 2 micro-batches per rank (``MICRO``: the rows of both gathered and summed in one update).
2. The embedding is a plain tensor on every rank (the decoder layers DTensors); updated by rows, each rank hands
   over its 2 × 16 ids and rows and gets both ranks'.
3. ``build_sharded`` from random init gives every rank the single-process values, bit for bit (the BF16 table
   built on meta and initialised whole by the replay; INT8 tables quantized from the whole model).
4. A DCP checkpoint after step 1 (the row moments, ``lazy_exact``'s per-row clock, the INT8 codes and scales),
   restored into a model and method built from other weights, continues to step 3 exactly as the uninterrupted run.

Tolerance (1): ``tests/test_fsdp2_hmt.py``'s ATOL = 1e-6 (its derivation: the clipping norm, now a sum over ranks,
moves the coefficient by a few ulps, which moves a weight by ≲ 2e-7, plus one ulp of the stored weight). The
embedding's rows are the same segment sums of the same gathered gradient rows as in the DDP test
(``tests/test_dist_sparse_embedding.py``); they differ from the reference only by the reordered clipping norm, so
the same bound holds for the BF16 table. The INT8 table is requantized by stochastic rounding from the same seeded
draws: an fp32 value moved by a few ulps lands on the other code only when it sits within those ulps of a rounding
threshold, so its dequantized rows are compared with the same ATOL, and a flipped code (one quantization step,
≈ max|row|/127 ≈ 1e-3 here) would fail it. Every tensor's worst difference is printed on failure.
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

from test_distributed import _reference, micro_rows, spawn_pair  # noqa: E402

STEPS = 3
ATOL = 1e-6  # see the module docstring
EMB = "model.embed_tokens"
CASES = {
    "bf16-lazy_exact": {"name": "hmt", "rank": 8, "update_interval": 2, "embedding_update": "lazy_exact",
                        "weight_decay": 0.01},
    "bf16-B-sparse_adam": {"name": "hmt", "mode": "B", "rank": 8, "update_interval": 2,
                           "embedding_update": "sparse_adam"},
    # INT8 embedding by rows and INT8 LM head (dense AdamW through its handle, reduced by the method's averager)
    "int8-lazy_exact": {"name": "hmt", "rank": 8, "update_interval": 2, "embedding_update": "lazy_exact",
                        "embedding_dtype": "int8", "weight_decay": 0.01},
    # INT8 tables updated densely (the embedding's (V, d) gradient all-reduced) and the INT8 head projected, Mode B
    # (its refresh and APOLLO scaling on the whole, averaged gradient, as under DDP)
    "int8-dense-B-head": {"name": "hmt", "mode": "B", "rank": 8, "update_interval": 2, "embedding_dtype": "int8",
                          "target_patterns": ["attn", "mlp", "lm_head"]},
    # the INT8 head projected in Mode A (refreshed from, and projecting, its whole averaged gradient), rows by lazy_exact
    "int8-A-head": {"name": "hmt", "rank": 8, "update_interval": 2, "embedding_update": "lazy_exact",
                    "embedding_dtype": "int8", "target_patterns": ["attn", "mlp", "lm_head"]},
}
# gradient accumulation, 2 micro-batches of 1 row per rank: the rows of both micro-batches are gathered and summed in
# one step (against single-process micro-batches that are the union of the ranks' micro-batches i)
MICRO = {"bf16-lazy_exact": 1, "bf16-B-sparse_adam": 2, "int8-lazy_exact": 2, "int8-dense-B-head": 1,
         "int8-A-head": 2}


def _built(ctx, overrides: dict, seed: int):
    """tiny_llama prepared by hmt (INT8 tables), sharded by FSDP2 around what hmt marks replicated, attached."""
    from experiments import methods
    from experiments.dist import parallel as distributed
    from helpers import tiny_llama

    cfg = methods.make_config({"name": "hmt", **{k: v for k, v in overrides.items() if k != "name"}})
    method = methods.make_method(cfg)
    model = distributed.shard_model(distributed.prepared(method, tiny_llama(seed=seed)), ctx)
    method.attach(model, max_grad_norm=1.0)
    method.set_lr_scale(1.0)
    assert distributed.wrap_for_forward(model, method, ctx) is model  # FSDP2: hmt's parallel context, no wrapper
    return model, method


def _local_state(state: dict, slots: dict) -> dict:
    """The single-process state with each row-sharded moment cut to this rank's rows (replicated slots whole)."""
    for name, st in state["slots"].items():
        s = slots[name]
        if s.shard is not None and st["m"] is not None and st["basis_left"] is None:
            st["m"], st["v"] = st["m"][s.shard.rows].clone(), st["v"][s.shard.rows].clone()
    return state


def _values(model) -> dict[str, torch.Tensor]:
    """Every weight's full value; an INT8 layer's as its dequantized fp32 matrix (codes and scales included)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hmt_core.int8_weights.codec import dequantize

    out = {k: v for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()
           if not k.endswith((".weight_codes", ".weight_scales"))}
    for name, m in model.named_modules():
        if hasattr(m, "weight_codes"):
            out[f"{name}.weight"] = dequantize(m.weight_codes, m.weight_scales, m.block, torch.float32)
    return out


def _load(model, weights: dict) -> None:
    """The reference's weights into the sharded model (full values; INT8 codes and scales copied in place)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from hmt_core.int8_weights import is_phantom

    params = dict(model.named_parameters())
    plain = {k: v.clone() for k, v in weights.items() if not is_phantom(params.get(k))}
    set_model_state_dict(model, plain, options=StateDictOptions(full_state_dict=True, strict=False))
    with torch.no_grad():
        for k, v in weights.items():
            if k.endswith((".weight_codes", ".weight_scales")):
                params[k].copy_(v)


def _case(ctx, overrides: dict, data, snaps, micro: int) -> dict:
    from experiments.loop import train_step
    from torch.distributed.tensor import DTensor

    model, method = _built(ctx, overrides, seed=1)
    emb = model.get_submodule(EMB)
    placed = {"embedding": [type(p).__name__ for p in emb.parameters()],
              "layer": type(model.model.layers[0].self_attn.q_proj.weight).__name__}
    gathered, rows = [], method.engine.reduce_grad.rows

    def record(ids, values):
        all_ids, all_values = rows(ids, values)
        gathered.append([list(ids.shape), list(values.shape), list(all_ids.shape), list(all_values.shape)])
        return all_ids, all_values

    method.engine.reduce_grad.rows = record
    slots = {s.name: s for s in method.opt.slots}
    half = data[0].shape[0] // ctx.world_size
    out = {"placed": placed, "diffs": [], "grads": []}
    reference = _reference_model(overrides)
    for x, snap in zip(data, snaps):
        _load(model, snap["weights"])
        method.load_state_dict(_local_state(torch.load(io.BytesIO(snap["method"]), weights_only=False), slots))
        batches = [x[r] for r in micro_rows(ctx.rank, ctx.world_size, half, micro)]
        train_step(model, method, batches, meter=None, autocast=contextlib.nullcontext, skip_nonfinite=True)
        out["grads"].append(all(p.grad is None for p in emb.parameters()))
        before, expected, after = _values_of(reference, snap["weights"]), _values_of(reference, snap["after"]), \
            _values(model)
        out["diffs"].append({k: [float((after[k].double() - v.double()).abs().max()),
                                 float((v.double() - before[k].double()).abs().max())] for k, v in expected.items()})
    out["gathered"] = gathered
    assert not isinstance(emb.weight, DTensor)
    return out


def _reference_model(overrides: dict):
    """A single-process model prepared like the reference's (to read a snapshot's INT8 layers as values)."""
    from experiments import methods
    from helpers import tiny_llama

    model = tiny_llama()
    methods.make_method(methods.make_config({k: v for k, v in overrides.items()})).prepare(model)
    return model


def _values_of(reference, weights: dict) -> dict[str, torch.Tensor]:
    reference.load_state_dict(weights)
    return {k: v.clone() for k, v in _values(reference).items()}


def _resume(ctx, overrides: dict, data, root: Path) -> dict[str, float]:
    """Steps 0-2 uninterrupted vs. step 0, a DCP checkpoint, restore into other weights, steps 1-2: name ->
    max|a − b| of the weights after step 2 (INT8 layers dequantized)."""
    from experiments.checkpoint import store as ck
    from experiments.checkpoint.dcp import DistCheckpointer
    from experiments.checkpoint.manager import LoopState, ResumePoint
    from experiments.loop import train_step

    half = data[0].shape[0] // ctx.world_size

    def build(seed: int):
        model, method = _built(ctx, overrides, seed)
        return model, method, DistCheckpointer(root, every=1, keep=1, model=model, method=method, meta={}, ctx=ctx)

    def step(model, method, x) -> None:
        train_step(model, method, [x[ctx.rank * half:(ctx.rank + 1) * half]], meter=None,
                   autocast=contextlib.nullcontext, skip_nonfinite=True)

    model, method, ckpt = build(0)
    saved = None
    for k, x in enumerate(data):
        if k == 1:
            saved = ckpt.save(LoopState(next_step=1, last_loss=1.5))
        step(model, method, x)
    expected = _values(model)
    model, method, ckpt = build(1)
    state = ckpt.restore(ResumePoint(saved.path, ck.verify(saved.path), []), torch.device("cpu"))
    assert state.next_step == 1, state
    for x in data[1:]:
        step(model, method, x)
    after = _values(model)
    return {k: float((after[k].double() - v.double()).abs().max()) for k, v in expected.items()}


def _start(ctx, overrides: dict) -> dict[str, float]:
    """``build_sharded`` from random init (a BF16 table: built on meta, the table initialised whole by the replay;
    INT8 tables: built whole, quantized, then sharded) vs. the single-process build, prepared: name -> max|a − b|."""
    from experiments import methods
    from experiments.config import ModelConfig
    from experiments.dist import parallel as distributed
    from experiments.models import build_model

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=176, vocab_size=256, dtype="fp32")

    def make():
        return methods.make_method(methods.make_config(overrides))

    torch.manual_seed(3)
    model = distributed.build_sharded(cfg, make(), ctx, vocab_size=None, device=torch.device("cpu"))
    torch.manual_seed(3)
    expected = _values(make().prepare(build_model(cfg, device=torch.device("cpu"))))
    after = _values(model)
    assert after.keys() == expected.keys(), (sorted(after), sorted(expected))
    return {k: float((after[k].double() - v.double()).abs().max()) for k, v in expected.items()}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from experiments.dist.parallel import DistContext
    from helpers import join_gloo, seeded_token_batches

    join_gloo(rank, world, port, timeout_s=60)
    try:
        data = seeded_token_batches(STEPS)
        ctx = DistContext(mode="fsdp2", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                          device=torch.device("cpu"))
        results = {}
        for case, overrides in CASES.items():
            micro = MICRO[case]
            results[case] = _case(ctx, overrides, data, _reference("hmt", overrides, data, micro=micro), micro)
            results[case]["resume"] = _resume(ctx, overrides, data, Path(out, f"ckpt-{case}"))
            results[case]["start"] = _start(ctx, overrides)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("fsdp2_rows"))


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_row_sparse_embedding_step_equals_the_single_process_global_batch(runs, case):
    for rank, res in runs.items():
        r = res[case]
        for step, diffs in enumerate(r["diffs"]):
            bad = {k: d for k, (d, _) in diffs.items() if d > ATOL}
            table = "\n".join(f"  {k}: max|a-b| {d:.3e} (update {m:.3e})" for k, (d, m) in diffs.items())
            assert not bad, f"{case}, rank {rank}, step {step}: weights differ from the reference:\n{table}"
            assert diffs[f"{EMB}.weight"][1] > 0, f"{case}: the embedding did not move at step {step}"
        print(f"{case} rank {rank}: embedding max|a-b| by step "
              f"{[d[f'{EMB}.weight'][0] for d in r['diffs']]}, all weights "
              f"{max(x for d in r['diffs'] for x, _ in d.values()):.3e}")


@pytest.mark.parametrize("case", list(CASES))
def test_the_embedding_is_whole_on_every_rank_and_its_rows_travel_as_rows(runs, case):
    for rank, res in runs.items():
        r = res[case]
        assert r["placed"]["layer"] == "DTensor" and "DTensor" not in r["placed"]["embedding"], r["placed"]
        assert all(r["grads"]), "the embedding kept a .grad"
        # 4 × 16 global tokens, hidden 64: each rank hands over its 2 × 16 ids and rows, and gets both ranks' 64
        rows, n = "embedding_update" in CASES[case], 32 // MICRO[case]  # a micro-batch's tokens on a rank
        assert r["gathered"] == ([[[n], [n, 64], [2 * n], [2 * n, 64]]] * STEPS * MICRO[case] if rows else []), \
            r["gathered"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_dcp_checkpoint_of_the_row_state_resumes_identically(runs, case):
    for rank, res in runs.items():
        diffs = {k: d for k, d in res[case]["resume"].items() if d != 0.0}
        table = "\n".join(f"  {k}: max|a-b| {d:.3e}" for k, d in diffs.items())
        assert not diffs, f"{case}, rank {rank}: the resumed steps differ from the uninterrupted ones:\n{table}"


@pytest.mark.parametrize("case", list(CASES))
def test_a_random_init_start_equals_the_single_process_build(runs, case):
    for rank, res in runs.items():
        diffs = {k: d for k, d in res[case]["start"].items() if d != 0.0}
        assert res[case]["start"] and not diffs, f"{case}, rank {rank}: the start differs from one process: {diffs}"
