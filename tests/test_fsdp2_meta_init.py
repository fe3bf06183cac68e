"""``dist=fsdp2`` starts on the meta device (``experiments.dist.meta_init``), on CPU with gloo, two processes:

1. every rank's shard holds exactly (``torch.equal``) its rows of the single-process init with the same seed,
   buffers (rotary ``inv_freq``) too, and the RNG ends in the same state — for the harness's Llama (untied and
   tied embeddings) and config-only GPT-2 (transformers' ``Conv1D`` draws in its constructor) and Qwen2 (biases);
   the sharded model's first loss equals the single-process model's;
2. the start-up peak per rank (``experiments.memory.meter.StartupPeak``) is this rank's shards + buffers + the largest
   parameter at full size, derived from the shapes, and below the old path's (whole
   model built, then sharded);
3. ``mode=train`` records it: ``memory.startup_peak_bytes`` and ``dist.startup_peak_max_bytes`` (torchrun, 2 ranks);
4. a model whose init cannot be replayed (a parameter no init reaches, a constructor drawing from tensor inputs) is
   refused with one line naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import free_port  # noqa: E402
from test_architectures import config_dir  # noqa: E402
from test_distributed import spawn_pair  # noqa: E402

SEED = 3
# FSDP2's and DeviceMesh's own small tensors born during fully_shard (24 bytes measured with torch 2.13)
BOOKKEEPING_BYTES = 256
# torch's compute_local_shape_and_global_offset (the shard's offsets) makes an int64 index of the local rows
INDEX_BYTES_PER_ROW = 8


def _cases(root: Path):
    from experiments.config import ModelConfig

    llama = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=176, vocab_size=256, dtype="fp32")
    return {"llama": ModelConfig(**llama), "llama-tied": ModelConfig(**llama, tie_embeddings=True),
            "gpt2": ModelConfig(path=str(config_dir(root, "gpt2")), dtype="fp32"),
            "qwen2": ModelConfig(path=str(config_dir(root, "qwen2")), dtype="bf16")}


class _Identity:
    """A method that keeps the model as built (the capabilities of hmt_core.method.Method it is asked for)."""

    shrinks_weights = False
    prepare_reads_values = False

    def prepare(self, model, *, device=None, materialize=None):
        return model


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _expected_peak(ref: torch.nn.Module, world: int) -> dict[str, int]:
    """Bytes from the shapes of the single-process model: every parameter's padded row shard (FSDP2's
    ``Shard(0)``: ⌈rows/W⌉ rows), the buffers, and the largest parameter at full size (the tensor ``meta_init``
    initialises before copying this rank's rows of it into the shard) with the index of its local rows."""
    def rows(p):
        return -(-p.shape[0] // world)

    def chunk(p):
        return _nbytes((rows(p), *p.shape[1:]), p.dtype)

    shards = sum(chunk(p) for p in ref.parameters())
    buffers = sum(_nbytes(b.shape, b.dtype) for b in ref.buffers())
    one = max(_nbytes(p.shape, p.dtype) + INDEX_BYTES_PER_ROW * rows(p) for p in ref.parameters())
    full = sum(_nbytes(p.shape, p.dtype) for p in ref.parameters())
    return {"shards": shards, "buffers": buffers, "one": one, "full": full}


def _case(ctx, cfg) -> dict:
    from experiments.dist import parallel as distributed
    from experiments.memory.meter import StartupPeak
    from experiments.models import build_model

    torch.manual_seed(SEED)
    with StartupPeak(torch.device("cpu")) as startup:
        model = distributed.build_sharded(cfg, _Identity(), ctx, vocab_size=None, device=torch.device("cpu"))
    rng_after = torch.get_rng_state()
    torch.manual_seed(SEED)
    with StartupPeak(torch.device("cpu")) as old:  # the previous start: the whole model, then fully_shard
        distributed.shard_model(build_model(cfg, device="cpu"), ctx)
    torch.manual_seed(SEED)
    ref = build_model(cfg, device="cpu")
    same_rng = torch.equal(rng_after, torch.get_rng_state())
    params = dict(ref.named_parameters())
    differ = [n for n, p in model.named_parameters()
              if not torch.equal(p.to_local(), torch.chunk(params[n].detach(), ctx.world_size, dim=0)[ctx.rank])]
    buffers = dict(ref.named_buffers())
    differ += [n for n, b in model.named_buffers() if not torch.equal(b, buffers[n])]
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # eval: GPT-2's dropout would draw differently in the two forwards
        losses = [float(m.eval()(input_ids=x, labels=x).loss) for m in (model, ref)]
    return {"differ": differ, "params": len(params), "same_rng": same_rng, "peak": startup.peak_bytes,
            "old_peak": old.peak_bytes, "losses": losses, **_expected_peak(ref, ctx.world_size)}


class _Uninitialised(torch.nn.Module):
    """A parameter no init reaches (no constructor draw, no ``_init_weights``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(4, 4))


class _DrawsFromATensor(torch.nn.Module):
    """A constructor that draws with tensor inputs (``torch.normal(mean_tensor, std)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.normal(torch.zeros(4, 4), 1.0))


def _refusals(ctx) -> list[str]:
    from experiments.dist import parallel as distributed
    from experiments.dist import meta_init

    def on_meta(make):
        with torch.device("meta"):
            return make()

    out = []
    for make in (_Uninitialised, _DrawsFromATensor):
        try:
            model, record = meta_init.record_build(lambda: on_meta(make))
            distributed.shard_model(model, ctx, build=record)
            out.append("accepted")
        except meta_init.UnreplayableInit as e:
            out.append(str(e))
    return out


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from experiments.dist import parallel as distributed
    from helpers import join_gloo

    join_gloo(rank, world, port)
    try:
        ctx = distributed.DistContext(mode="fsdp2", rank=rank, world_size=world, local_rank=rank, backend="gloo",
                                      device=torch.device("cpu"))
        results = {name: _case(ctx, cfg) for name, cfg in _cases(Path(out)).items()}
        results["refusals"] = _refusals(ctx)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def starts(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("fsdp2_meta_init"))


CASES = ("llama", "llama-tied", "gpt2", "qwen2")


@pytest.mark.parametrize("case", CASES)
def test_each_shard_holds_exactly_its_rows_of_the_single_process_init(starts, case):
    for rank, results in starts.items():
        r = results[case]
        print(f"{case} rank {rank}: {len(r['differ'])} of {r['params']} parameters/buffers differ: {r['differ']}; "
              f"RNG state after the start equal: {r['same_rng']}; first loss {r['losses']}")
        assert r["differ"] == [] and r["same_rng"], r
        # the same weights and the same fp32/bf16 ops (FSDP2 all-gathers them whole before each layer): 1e-6 relative
        # leaves room only for a different reduction order inside a kernel
        assert abs(r["losses"][0] - r["losses"][1]) <= 1e-6 * abs(r["losses"][1]), r["losses"]


@pytest.mark.parametrize("case", CASES)
def test_the_start_up_peak_is_one_shard_plus_one_parameter(starts, case):
    for rank, results in starts.items():
        r = results[case]
        expected = r["shards"] + r["buffers"] + r["one"]
        print(f"{case} rank {rank}: start-up peak {r['peak']} B, expected {expected} B (shards {r['shards']} + "
              f"buffers {r['buffers']} + the largest parameter {r['one']}); whole model {r['full']} B; "
              f"old start (build whole, then shard) {r['old_peak']} B")
        assert abs(r["peak"] - expected) <= BOOKKEEPING_BYTES, (r["peak"], expected)
        assert r["old_peak"] >= r["full"] > r["peak"], r


def test_mode_train_under_torchrun_records_the_start_up_peak(tmp_path):
    """Two ranks of ``mode=train`` (fsdp2, adamw, 1 step, fp32): the summary carries rank 0's start-up peak and the
    maximum over ranks, each half the model (every row count is even) + the rotary buffers + the largest weight at
    full size (the embedding or lm_head, V x 64 fp32 with V/2 local rows, or an MLP weight, 256 x 64 with 128) within
    BOOKKEEPING_BYTES."""
    overrides = ["model.hidden_size=64", "model.num_layers=3", "model.num_heads=2", "model.intermediate_size=256",
                 "model.vocab_size=512", "model.dtype=fp32", "train.autocast=false", "train.seq_len=32",
                 "train.batch_size=2", "train.steps=1", "train.warmup_steps=0", "train.eval_every=1",
                 "train.eval_batches=1", "train.progress=false", "method=adamw", "device=cpu", "dist=fsdp2", "run_id=r"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "experiments.run", f"results_dir={tmp_path}", *overrides]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    vocab = summary["data"]["vocab_size"]
    whole = 4 * summary["params_total"]
    largest = 4 * 64 * max(vocab, 256) + INDEX_BYTES_PER_ROW * max(vocab, 256) // 2
    expected = whole // 2 + 2 * 4 * 16 + largest  # inv_freq, original_inv_freq: head_dim/2 fp32 each
    startup, startup_max = summary["memory"]["startup_peak_bytes"], summary["dist"]["startup_peak_max_bytes"]
    print(f"start-up peak: rank 0 {startup} B, max over ranks {startup_max} B, expected {expected} B; "
          f"whole model {whole} B (vocab {vocab})")
    assert abs(startup - expected) <= BOOKKEEPING_BYTES and abs(startup_max - expected) <= BOOKKEEPING_BYTES
    assert startup_max < whole, (startup_max, whole)


def test_a_model_whose_init_cannot_be_replayed_is_refused_in_one_line(starts):
    for rank, results in starts.items():
        uninitialised, draws = results["refusals"]
        print(f"rank {rank}: {results['refusals']}")
        assert uninitialised.startswith("w: the model's _init_weights leaves it uninitialised"), uninitialised
        assert "aten.normal.Tensor_float" in draws and "tensor inputs" in draws, draws
        assert "\n" not in uninitialised + draws
