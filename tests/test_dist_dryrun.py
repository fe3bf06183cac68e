"""Per-rank dry run (``mode=dryrun dist=ddp|fsdp2 dist.world_size=W``): rank 0 of a fake process group, traced in
one process under FakeTensorMode, measures what rank 0 of a real multi-process run measures.

1. Fake vs real: the same ``experiments.dryrun.trace_steps`` runs on real tensors in 2 processes (gloo, real
   collectives, ``fake=False``) and on fake tensors with the fake process group at W=2; rank 0's peak, per-phase
   peaks and peak-by-category agree within 1 % (FSDP2 adamw, galore, apollo and hmt with its embedding left whole
   on every rank, BF16 by rows or INT8; DDP adamw / per-layer hmt).
2. Shapes: under FSDP2 the optimizer state at W=4 is exactly the sum over parameters of rank 0's dim-0 chunk
   (``ceil(rows / 4)`` rows, FSDP2's ``torch.chunk`` split) of each moment, i.e. 1/4 of W=1 up to that rounding;
   parameters and gradients likewise. At W=1 the fake process group's params/grads/optimizer equal the plain dry
   run's; DDP's peak is the plain one plus exactly its gradient bucket buffer. What hmt leaves out of the shards
   (a row-updated embedding, INT8 tables) is counted whole at W=4, the other parameters by their chunks.
3. Bad input (``dist.world_size`` outside a dry run, a batch not divisible by W) fails with one line.

Why 1 %: fake tensors carry shapes, dtypes and storages exactly, so every allocation has the real size; what
can differ is only which storages are alive at the peak op when the real collectives (gloo) allocate
scratch tensors the fake process group does not (measured: identical bytes in every category here), and, under
FSDP2, when gloo's background thread releases a unit's reduce-scatter input (at most one such buffer; see the test).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments import methods
from experiments.config import register_configs, to_run_config
from experiments.dryrun import trace_steps

register_configs()
CONF = str(Path(__file__).resolve().parent.parent / "experiments" / "conf")
MICRO = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=176",
         "model.vocab_size=512", "train.seq_len=64", "train.batch_size=4", "dryrun.steps=2"]
# FSDP2 reduces a unit's gradients as one flat FP32 buffer (reduce_dtype=fp32, experiments.dist.parallel.shard_model):
# in MICRO a decoder layer's unsharded gradients (q, k, v, o: 4 x 64 x 64; gate, up, down: 3 x 64 x 176; two norms
# of 64) and the root's (embedding and lm_head, 512 x 64 each, and the final norm of 64), 4 bytes each. The largest
# is the one buffer whose release a real run may delay.
LAYER_RS_INPUT_BYTES = (4 * 64 * 64 + 3 * 64 * 176 + 2 * 64) * 4
ROOT_RS_INPUT_BYTES = (2 * 512 * 64 + 64) * 4
LATE_RS_INPUT_BYTES = max(LAYER_RS_INPUT_BYTES, ROOT_RS_INPUT_BYTES)
CASES = {
    "fsdp2-adamw": ["dist=fsdp2", "method=adamw"],
    "ddp-adamw": ["dist=ddp", "method=adamw"],
    "ddp-hmt": ["dist=ddp", "method=hmt", "method.rank=8", "method.update_interval=1"],  # hmt's own all-reduce
    "fsdp2-galore": ["dist=fsdp2", "method=galore", "method.rank=8", "method.update_proj_gap=1"],  # SVD each step
    "fsdp2-apollo": ["dist=fsdp2", "method=apollo", "method.rank=8"],
    # the embedding left whole on every rank (BF16 updated by rows; INT8 tables, the head's gradient all-reduced)
    "fsdp2-hmt-rows": ["dist=fsdp2", "method=hmt", "method.rank=8", "method.embedding_update=lazy_exact"],
    "fsdp2-hmt-int8-rows": ["dist=fsdp2", "method=hmt", "method.rank=8", "method.embedding_update=sparse_adam",
                            "method.embedding_dtype=int8"],
}


def _run(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_run_config(compose("run", overrides=["mode=dryrun", *MICRO, *overrides]))


def _trace(run, *, fake: bool = True) -> dict:
    return trace_steps(run, methods.make_method(run.method), fake=fake)


def _figures(rep) -> dict:
    return {"peak": rep.peak_bytes, "phases": dict(rep.peak_by_phase_bytes),
            "categories": dict(rep.peak_by_category_bytes), "current": dict(rep.current_by_category_bytes)}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from helpers import join_gloo

    join_gloo(rank, world, port)
    try:
        results = {name: _figures(_trace(_run(*o, f"dist.world_size={world}"), fake=False)["report"])
                   for name, o in CASES.items()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def real() -> dict:
    """Rank 0's meter in a real 2-process gloo run of every case."""
    import tempfile

    from helpers import free_port, spawn_gloo

    with tempfile.TemporaryDirectory() as out:
        spawn_gloo(_worker, (2, free_port(), out), nprocs=2)
        return json.loads(Path(out, "rank0.json").read_text())


def _close(actual: dict, expected: dict, *, late_bytes: int = 0, either_way: bool = False) -> list[str]:
    """Rows that differ by more than 1 % (categories: or 64 bytes, a step counter's size) — printed on failure.

    ``late_bytes``: the real run (``expected``) may hold up to this many bytes more than the fake one, never less;
    ``either_way``: more or less (a category split of a peak whose total is held to the one-sided rule).
    """
    bad = []
    for key, value in expected.items():
        if isinstance(value, dict):
            split = key == "categories"
            bad += [f"{key}.{row}" for row in _close(actual[key], value, late_bytes=late_bytes, either_way=split)]
            continue
        slack = max(0.01 * abs(value), 64)
        if not -slack - (late_bytes if either_way else 0) <= value - actual[key] <= slack + late_bytes:
            bad.append(f"{key}: fake {actual[key]:,} vs real {value:,}")
    return bad


@pytest.mark.parametrize("name", list(CASES))
def test_fake_process_group_rank0_equals_real_two_process_rank0(real, name):
    fake = _figures(_trace(_run(*CASES[name], "dist.world_size=2"))["report"])
    # FSDP2's reduce-scatters run on gloo's background thread, which drops its reference to a unit's input buffer
    # (the unit's unsharded BF16 gradients) only some time after the collective completed: now and then a real
    # run still holds one such buffer at a later peak. Seen under load: +65,682 B and +131,200 B (the root's) in
    # the optimizer phase, +100,620 B (a decoder layer's, 100,608 B) at the backward peak, the bytes landing in
    # whatever category the meter was counting. Timing, not bytes: the real run may exceed the fake one by at
    # most the largest such buffer, in any row, and never fall below it by more than 1 %. A peak's split into
    # categories may move that buffer's bytes either way: at an equal forward peak (1,956,444 B both) a real run
    # once counted 100,608 B more activations and 100,608 B less temp than the fake one (a layer's buffer held late
    # where the fake run held a temporary of the same size), so a category row may also fall below by that much;
    # the peaks and phases keep the one-sided rule. DDP reduces into its persistent bucket buffers, which nothing
    # releases late, so it keeps the plain 1 %.
    late = LATE_RS_INPUT_BYTES if name.startswith("fsdp2") else 0
    bad = _close(fake, real[name], late_bytes=late)
    assert not bad, f"{name}: fake W=2 vs real 2-process rank 0:\n  " + "\n  ".join(bad) + f"\nfake {fake}\nreal {real[name]}"


def _rank0_chunk_bytes(shapes: list[torch.Size], world: int, elem: int) -> int:
    """Rank 0's dim-0 chunk of each tensor: ``torch.chunk`` gives it ceil(rows / W) rows."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) * elem for s in shapes)


def test_fsdp2_shards_optimizer_state_params_and_grads_by_shapes():
    plain = _trace(_run("method=adamw"))
    shapes = [p.shape for p in _trace_model_shapes()]
    elem = 2  # bf16 weights, bf16 AdamW moments (the model's dtype)
    steps = 4 * len(shapes)  # AdamW's fp32 step counter per parameter
    by_w = {w: _trace(_run("dist=fsdp2", "method=adamw", f"dist.world_size={w}"))["report"] for w in (1, 4)}
    for w, rep in by_w.items():
        cur = rep.current_by_category_bytes
        expected_opt = 2 * _rank0_chunk_bytes(shapes, w, elem) + steps
        assert cur["optimizer"] == expected_opt, (w, cur["optimizer"], expected_opt)
        assert cur["params"] == _rank0_chunk_bytes(shapes, w, elem), (w, cur["params"])
        grads = rep.peak_by_phase_category_bytes["optimizer"]["grads"]
        assert grads == _rank0_chunk_bytes(shapes, w, elem), (w, grads)
    ratio = by_w[4].current_by_category_bytes["optimizer"] / by_w[1].current_by_category_bytes["optimizer"]
    assert 0.25 <= ratio < 0.25 * 1.05, ratio  # 1/4 up to ceil(rows / 4) rounding and the step counters
    p = plain["report"].current_by_category_bytes
    w1 = by_w[1].current_by_category_bytes
    assert (w1["params"], w1["optimizer"]) == (p["params"], p["optimizer"]), (w1, p)


@pytest.mark.parametrize("extra", [["method.embedding_update=lazy_exact"],
                                   ["method.embedding_update=sparse_adam", "method.embedding_dtype=int8"]])
def test_fsdp2_counts_a_replicated_table_whole_and_the_rest_by_shards(extra):
    """What hmt leaves out of FSDP2's shards (``hmt_core.parallel.is_replicated``: the row-updated embedding, INT8
    codes and scales, a phantom's one element) is held whole by rank 0 at every W; every other parameter is its
    ``torch.chunk`` dim-0 chunk. Expected bytes from the single-process prepared model's tensors."""
    from experiments.models import build_model
    from hmt_core.parallel import is_replicated

    run = _run("dist=fsdp2", "method=hmt", "method.rank=8", *extra, "dist.world_size=4")
    model = methods.make_method(run.method).prepare(build_model(run.model, device="cpu"))
    whole = sum(p.untyped_storage().nbytes() for p in model.parameters() if is_replicated(p))
    sharded = [p for p in model.parameters() if not is_replicated(p)]
    assert whole > 0 and sharded
    params = _trace(run)["report"].current_by_category_bytes["params"]
    expected = whole + _rank0_chunk_bytes([p.shape for p in sharded], 4, sharded[0].element_size())
    assert params == expected, (extra, params, expected, whole)


def _trace_model_shapes():
    from experiments.models import build_model

    return list(build_model(_run("method=adamw").model, device="cpu").parameters())


def test_fsdp2_frees_each_gathered_weight_after_use():
    """FSDP2 frees an all-gathered weight with ``storage.resize_(0)`` (no ATen op); the meter must see it. At W=1
    the step then holds the plain step's activations plus only the root module's unsharded weights (embedding,
    lm_head, final norm: FSDP2 does not reshard the root after forward), not a second copy of every weight."""
    plain = _trace(_run("method=adamw", "train.batch_size=1"))["report"]
    one = _trace(_run("method=adamw", "dist=fsdp2", "dist.world_size=1", "train.batch_size=1"))["report"]
    h, v = 64, 512
    root = 2 * (v * h + v * h + h)  # bf16 embedding, lm_head, final norm weight
    # at the forward's peak (the step's peak is in backward under FSDP2: its fp32 reduce-scatter input, twice the
    # bf16 gradients, moves it past the moment the activations are all held)
    got = one.peak_by_phase_category_bytes["forward"]["activations"]
    want = plain.peak_by_phase_category_bytes["forward"]["activations"] + root
    assert got == want, (got, want, plain.peak_by_phase_category_bytes["forward"]["activations"], root)


def test_ddp_at_world_size_one_is_the_plain_dry_run_plus_its_gradient_buckets():
    """DDP replicates: params, grads and optimizer state are the plain run's; the reducer adds one flat bucket
    buffer holding every gradient (bf16 here), which stays alive between steps."""
    plain = _trace(_run("method=adamw"))["report"]
    ddp = _trace(_run("dist=ddp", "method=adamw", "dist.world_size=1"))["report"]
    buckets = sum(p.numel() * 2 for p in _trace_model_shapes())
    for key in ("params", "grads", "optimizer"):
        assert ddp.peak_by_category_bytes[key] == plain.peak_by_category_bytes[key], (key, ddp, plain)
    assert ddp.current_by_category_bytes["temp"] - plain.current_by_category_bytes["temp"] == buckets, (ddp, plain)
    assert ddp.peak_bytes - plain.peak_bytes == buckets, (ddp.peak_bytes, plain.peak_bytes, buckets)


def test_summary_reports_the_world_size_and_per_rank_batch(tmp_path):
    from experiments.execute import main_with_config

    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("run", overrides=["mode=dryrun", *MICRO, "dist=fsdp2", "method=adamw", "dist.world_size=64",
                                        "train.batch_size=64", f"results_dir={tmp_path}", "run_id=t"])
    summary = main_with_config(cfg)
    assert summary["dist"] == {"mode": "fsdp2", "world_size": 64, "backend": "fake", "rank": 0,
                               "batch_semantics": "global", "rank_batch_size": 1}, summary["dist"]


@pytest.mark.parametrize("overrides,fragments", [
    (["mode=train", "dist=fsdp2", "dist.world_size=8"], ["dist.world_size=8", "mode=dryrun"]),
    (["mode=dryrun", "dist=fsdp2", "dist.world_size=3"], ["train.batch_size=4", "dist.world_size=3"]),
    (["mode=dryrun", "dist=fsdp2", "method=qlora", "dist.world_size=2"], ["dist=fsdp2", "method=qlora"]),
    (["mode=dryrun", "dist=ddp"], ["dist.world_size=N"]),
    (["mode=dryrun", "dist.world_size=2"], ["dist.world_size=2", "dist=ddp"]),
])
def test_bad_per_rank_dry_runs_fail_with_one_line(capsys, tmp_path, overrides, fragments):
    from experiments.execute import main_with_config

    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("run", overrides=[*MICRO, "method=adamw", *overrides, f"results_dir={tmp_path}"])
    with pytest.raises(SystemExit) as exc:
        main_with_config(cfg)
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(f in lines[0] for f in fragments), (fragments, lines[0])
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written
