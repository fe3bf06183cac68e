"""The GPU allowance lines (``experiments.memory.gpu_allowance``) and the dry run's modeled verdict: reserved bytes
replayed through the caching allocator plus the lines outside it, worked out by hand. Exact integers throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.config import to_run_config
from experiments.memory.gpu_allowance import GpuTarget, allowance_for, modeled_verdicts
from experiments.execute import main_with_config

MiB, GIB = 2**20, 2**30
CONF = str(Path(__file__).resolve().parent.parent / "experiments" / "conf")
CONTEXT_HOPPER = 1_677_590_528  # context + the kernels and libraries a step loads, measured on an H200


def _lines(target: GpuTarget) -> dict[str, int]:
    return {line.name: line.bytes for line in allowance_for(target).lines}


def test_single_gpu_lines_per_generation():
    hopper = allowance_for(GpuTarget(arch="hopper"))
    assert all(line.source for line in hopper.lines)
    assert hopper.outside_bytes == CONTEXT_HOPPER
    # cuBLAS 32 MiB + cuBLASLt 1 MiB, for the main thread and autograd's device thread (one handle each)
    assert hopper.prelude() == ((32 * MiB, 0), (MiB, 0), (32 * MiB, 0), (MiB, 0))
    ampere = allowance_for(GpuTarget(arch="ampere", gemm_threads=1))
    assert ampere.prelude() == ((4096 * 1024 * 2 + 16 * 1024 * 8, 0), (MiB, 0))  # ":4096:2:16:8"
    assert ampere.outside_bytes == CONTEXT_HOPPER  # no Ampere measurement: Hopper's is the bound
    assert "no ampere measurement" in ampere.lines[0].source
    with pytest.raises(ValueError, match="gpu_arch"):
        GpuTarget(arch="kepler")


def test_distributed_lines():
    lines = _lines(GpuTarget(world_size=2, dist_mode="fsdp2", fsdp_unit_bytes=100 * MiB, nccl_channels=32))
    nccl = next(v for k, v in lines.items() if k.startswith("NCCL"))
    assert nccl == 32 * (4 * MiB + 4_915_200 + 524_288)  # Simple + LL128 + LL per channel
    assert next(v for k, v in lines.items() if k.startswith("FSDP2")) == 300 * MiB
    assert not any(k.startswith(("NCCL", "FSDP2")) for k in _lines(GpuTarget(world_size=1)))
    ddp = _lines(GpuTarget(world_size=2, dist_mode="ddp"))
    assert any(k.startswith("NCCL") for k in ddp) and not any(k.startswith("FSDP2") for k in ddp)


def test_modeled_verdict_at_the_edge():
    """Hopper prelude: two 32 MiB workspaces (32 MiB segments each) and two 1 MiB ones (one 2 MiB small segment):
    66 MiB reserved. A tensor of X bytes (X >= 10 MiB, a multiple of 2 MiB) adds an X-byte segment; on 16 GiB it
    fits exactly when 66 MiB + X = 16 GiB - outside lines."""
    allowance = allowance_for(GpuTarget(arch="hopper"))
    capacity = 16 * GIB - allowance.outside_bytes
    x = (capacity - 66 * MiB) // (2 * MiB) * (2 * MiB)
    edge = modeled_verdicts([[(0, x, 1, "cpu")]], allowance, (16,))
    assert edge["predicted"]["peak_reserved_bytes"] == 66 * MiB + x, edge
    assert edge["verdicts"]["16GiB"] == {"fits": True, "headroom_bytes": capacity - 66 * MiB - x}, edge
    over = modeled_verdicts([[(0, x + 2 * MiB, 1, "cpu")]], allowance, (16,))
    assert over["verdicts"]["16GiB"]["fits"] is (capacity - 66 * MiB - x >= 2 * MiB), (over, capacity)


def test_modeled_verdict_counts_the_release_and_retry():
    """A 6 GiB tensor freed, then a 10 GiB one: 16 GiB + 66 MiB reserved unlimited (the 6 GiB segment stays
    cached), which exceeds a 16 GiB GPU; capped there, the allocator releases the free 6 GiB segment and the 10 GiB
    one fits: 10 GiB + 66 MiB reserved."""
    allowance = allowance_for(GpuTarget(arch="hopper"))
    log = [(0, 6 * GIB, 1, "cpu"), (1, -6 * GIB, 1, "cpu"), (2, 10 * GIB, 2, "cpu")]
    out = modeled_verdicts([log], allowance, (16, 10))
    assert out["predicted"]["peak_reserved_bytes"] == 16 * GIB + 66 * MiB, out
    capacity = 16 * GIB - allowance.outside_bytes
    assert out["verdicts"]["16GiB"] == {"fits": True, "headroom_bytes": capacity - 10 * GIB - 66 * MiB}, out
    assert out["verdicts"]["10GiB"]["fits"] is False, out


def test_dryrun_judges_by_reserved_plus_allowance(tmp_path, capsys):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("run", overrides=["mode=dryrun", "method=adamw", "model=tiny", "model.num_layers=1",
                                        "train.seq_len=32", "train.batch_size=1", "dryrun.gpu_sizes_gib=[1,2,16]",
                                        f"results_dir={tmp_path}", "run_id=g"])
    assert to_run_config(cfg).dryrun.reserve == "modeled"
    d = main_with_config(cfg)["dryrun"]
    pred, outside = d["predicted"], d["allowance"]["outside_bytes"]
    # reserved >= allocated >= the live peak + the 66 MiB of workspaces the replay starts with
    assert pred["peak_reserved_bytes"] >= pred["peak_allocated_bytes"] >= d["verdict_peak_bytes"] + 66 * MiB, d
    assert d["verdicts"]["16GiB"] == {"fits": True,
                                      "headroom_bytes": 16 * GIB - outside - pred["peak_reserved_bytes"]}, d
    # a 1-layer tiny model: 1.56 GiB of context, kernels and libraries (measured on an H200) + ~0.09 GiB reserved
    # fit 2 GiB, not 1 GiB
    assert d["verdicts"]["2GiB"] == {"fits": True, "headroom_bytes": 2 * GIB - outside - pred["peak_reserved_bytes"]}, d
    assert d["verdicts"]["1GiB"] == {"fits": False, "headroom_bytes": GIB - outside - pred["peak_reserved_bytes"]}, d
    out = capsys.readouterr().out
    assert "cuBLAS workspace" in out and "CublasHandlePool.cpp" in out and "fits (reserved + allowance)" in out
    with initialize_config_dir(config_dir=CONF, version_base=None):
        flat = compose("run", overrides=["mode=dryrun", "method=adamw", "model=tiny", "model.num_layers=1",
                                         "train.seq_len=32", "train.batch_size=1", "dryrun.gpu_sizes_gib=[1]",
                                         "dryrun.reserve=flat", f"results_dir={tmp_path}", "run_id=f"])
    f = main_with_config(flat)["dryrun"]
    assert f["verdicts"]["1GiB"] == {"fits": False, "headroom_bytes": -f["verdict_peak_bytes"]}, f
    assert f["predicted"] == pred  # the same trace: the allocator figures are reported in either mode


def test_expandable_segments_change_the_replay_only():
    """``dryrun.expandable_segments=true`` on the 6 GiB-then-10 GiB sequence above: one growing segment per pool.
    Large pool: the two 32 MiB workspaces map 80 MiB (64 live + a 16 MiB free tail); 6 GiB grows the tail by 307
    pages of 20 MiB; freed, it merges back into the tail (6,156 MiB), which 10 GiB grows by 205 pages: 10,320 MiB
    mapped = 516 pages, i.e. the 10,304 MiB live at the end rounded up to a page (no hole is left behind). Small
    pool: one 2 MiB page holds both 1 MiB workspaces. Reserved: 10,322 MiB (native: 16 GiB + 66 MiB)."""
    allowance = allowance_for(GpuTarget(arch="hopper"))
    log = [(0, 6 * GIB, 1, "cpu"), (1, -6 * GIB, 1, "cpu"), (2, 10 * GIB, 2, "cpu")]
    out = modeled_verdicts([log], allowance, (16,), expandable_segments=True)
    assert out["predicted"]["peak_reserved_bytes"] == 10_322 * MiB, out
    capacity = 16 * GIB - allowance.outside_bytes
    assert out["verdicts"]["16GiB"] == {"fits": True, "headroom_bytes": capacity - 10_322 * MiB}, out


def test_fsdp2_dry_run_allowance_counts_nccl_and_the_largest_unit():
    """A 2-rank FSDP2 dry run (fake process group) of a micro Llama (h 64, 2 layers, MLP 176, vocab 512, BF16):
    a decoder layer's unit holds 4·64·64 (attention) + 3·64·176 (MLP) + 2·64 (norms) = 50,304 parameters, the root
    unit the embedding and the untied lm_head (2·512·64) + the final norm (64) = 65,600: 131,200 bytes unsharded,
    the largest; the pools' bound is 2 of it (all-gather outputs) + its 65,600 elements in fp32 (the reduce-scatter
    input, ``reduce_dtype=fp32``). NCCL: 32 channels of Simple + LL128 + LL buffers."""
    from experiments import methods
    from experiments.dryrun import trace_steps
    from experiments.memory.gpu_allowance import allowance_of_trace

    micro = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=176",
             "model.vocab_size=512", "train.seq_len=64", "train.batch_size=4", "dryrun.steps=1"]
    with initialize_config_dir(config_dir=CONF, version_base=None):
        run = to_run_config(compose("run", overrides=["mode=dryrun", *micro, "dist=fsdp2", "dist.world_size=2",
                                                      "method=adamw"]))
    assert not run.model.tie_embeddings
    traced = trace_steps(run, methods.make_method(run.method))
    assert traced["fsdp_unit_bytes"] == 131_200, traced["fsdp_unit_bytes"]
    assert traced["fsdp_unit_reduce_bytes"] == 65_600 * 4, traced["fsdp_unit_reduce_bytes"]
    lines = {line.name: line.bytes for line in allowance_of_trace(run, traced).lines}
    assert next(v for k, v in lines.items() if k.startswith("FSDP2")) == 2 * 131_200 + 65_600 * 4, lines
    old_trace = {k: v for k, v in traced.items() if k != "fsdp_unit_reduce_bytes"}  # recorded before fp32 reduction
    lines = {line.name: line.bytes for line in allowance_of_trace(run, old_trace).lines}
    assert next(v for k, v in lines.items() if k.startswith("FSDP2")) == 3 * 131_200, lines
    assert next(v for k, v in lines.items() if k.startswith("NCCL")) == 32 * (4 * MiB + 4_915_200 + 524_288), lines
