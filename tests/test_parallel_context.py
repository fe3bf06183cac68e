"""The parallel context a method receives (``hmt_core.parallel.ParallelContext`` through ``Method.set_parallel``)
and the trainer's single process as world size 1 (``experiments.dist.context.DistContext.single``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from baselines import adamw
from experiments.checkpoint.dcp import DistCheckpointer
from experiments.checkpoint.manager import Checkpointer
from experiments.dist import parallel
from experiments.dist.context import DistContext
from hmt_core import hmt
from hmt_core.parallel import SINGLE_PROCESS, ParallelContext
from tests.helpers import batches, tiny_llama


class ScaledReducer:
    """A ``GradReducer`` for one process that multiplies every gradient handed to it by ``factor`` (1: the mean
    over one rank) and records the names, in the order they came."""

    lowrank = False
    world_size = 1

    def __init__(self, factor: float) -> None:
        self.factor, self.names, self.flushes = factor, [], 0

    def full(self, grad: torch.Tensor, name: str, done) -> None:
        grad.mul_(self.factor)
        self.names.append(name)
        done()

    def projected(self, low: torch.Tensor, done) -> None:
        raise AssertionError("lowrank=False: no projected gradient is handed over")

    def flush(self) -> None:
        self.flushes += 1

    def rows(self, ids, values):
        return ids, values


def _hmt(per_layer: bool):
    model = tiny_llama(dtype=torch.float64)
    method = hmt.make(hmt.Config(rank=8, update_interval=1, per_layer=per_layer, lr=1e-2))
    method.attach(model, max_grad_norm=None)
    return model, method


def _step(model, method, ids: torch.Tensor) -> None:
    method.start_micro_batch(0, 1)
    model(input_ids=ids, labels=ids).loss.backward()
    method.step()
    method.zero_grad()


def test_per_layer_hmt_takes_the_reducer_and_runs_it_in_backward():
    """One step from the same state: with a reducer that keeps each gradient (the mean over one rank), per-layer
    HMT updates exactly as without one (same ops on the same values, tolerance 0), and the reducer saw every
    trainable parameter once. Control: a reducer that flips the gradients' sign changes the update (Adam is
    nearly invariant to a gradient's scale, not to its sign)."""
    ids = batches(1)[0]
    (plain_model, plain), (kept_model, kept), (flipped_model, flipped) = _hmt(True), _hmt(True), _hmt(True)
    identity, flip = ScaledReducer(1.0), ScaledReducer(-1.0)
    assert kept.set_parallel(ParallelContext(world_size=2, reduce_grad=identity)) is True
    assert flipped.set_parallel(ParallelContext(world_size=2, reduce_grad=flip)) is True
    for model, method in ((plain_model, plain), (kept_model, kept), (flipped_model, flipped)):
        _step(model, method, ids)
    trainable = sorted(n for n, p in kept_model.named_parameters() if p.requires_grad)
    assert sorted(identity.names) == trainable, (sorted(identity.names), trainable)
    assert identity.flushes >= 1
    for (name, a), b in zip(plain_model.named_parameters(), kept_model.parameters()):
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item():.3e}"
    moved = max((a - b).abs().max().item() for a, b in zip(plain_model.parameters(), flipped_model.parameters()))
    # Adam's first step moves a weight by about lr (1e-2) in the direction of -sign(g): flipped, a weight differs
    # by up to 2·lr; 1e-4 is 1% of one step
    assert moved > 1e-4, f"flipping the gradients moved no weight by more than {moved:.3e}: the reducer did not run"


def test_methods_that_leave_the_reduction_to_the_wrapper_say_so():
    """``False``: the caller's wrapper (DDP) reduces. HMT with ``per_layer=false`` and a torch.optim baseline take
    no reducer; every method accepts one process (``SINGLE_PROCESS``)."""
    model, ordinary = _hmt(False)
    baseline = adamw.make(adamw.Config())
    baseline.attach(model, max_grad_norm=None)
    reducer = ScaledReducer(1.0)
    for method in (ordinary, baseline, _hmt(True)[1]):
        assert method.set_parallel(SINGLE_PROCESS) is False, method
    for method in (ordinary, baseline):
        assert method.set_parallel(ParallelContext(world_size=2, reduce_grad=reducer)) is False, method


@pytest.mark.parametrize("which", ["hmt", "adamw"])
def test_sketch_refresh_without_row_shards_is_refused(which):
    model, method = _hmt(True)
    if which == "adamw":
        method = adamw.make(adamw.Config())
        method.attach(model, max_grad_norm=None)
    with pytest.raises(ValueError, match="dist.refresh=sketch needs method=hmt on FSDP2 shards"):
        method.set_parallel(ParallelContext(world_size=2, refresh_mode="sketch"))


def test_parallel_context_refuses_bad_values():
    with pytest.raises(ValueError, match="world_size=0"):
        ParallelContext(world_size=0)
    with pytest.raises(ValueError, match="refresh_mode='svd'"):
        ParallelContext(refresh_mode="svd")


def test_one_process_is_world_size_one(tmp_path: Path):
    """``DistContext.single``: every per-rank choice of the trainer is the single-process one, and no collective
    runs (no process group exists here)."""
    ctx = DistContext.single(torch.device("cpu"))
    assert (ctx.world_size, ctx.rank, ctx.is_main, ctx.distributed, ctx.loop_sync) == (1, 0, True, False, None)
    corpus, run_dir, cfg = SimpleNamespace(train="rows"), SimpleNamespace(path=tmp_path), SimpleNamespace()
    assert ctx.shard(corpus) is corpus and ctx.run_dir(run_dir) is run_dir and ctx.train_config(cfg) is cfg
    with ctx.rank_zero_first():
        ctx.barrier()
    assert ctx.summary_block(10, 5) == {} and ctx.memory_metrics(10.0) == {}
    losses = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert ctx.mean_over_ranks(losses) is losses and ctx.gather_floats(3.0) == [3.0]
    assert not ctx.is_peer_failure(RuntimeError("Connection closed by peer"))
    model, method = _hmt(True)
    ckpt = ctx.checkpointer(tmp_path / "ckpt", every=0, keep=1, model=model, method=method, meta={})
    assert type(ckpt) is Checkpointer and not isinstance(ckpt, DistCheckpointer)
    assert parallel.wrap_for_forward(model, method, ctx) is model
    ctx.teardown()
