"""Host syncs of the training loop and of the baselines' ``step``, and the on-device skip of a non-finite step, on
CPU.

Host syncs are counted by ``experiments.dispatch_counter.DispatchCounter`` (``.item()``/``bool(t)``/``float(t)``,
data-dependent shapes, tensors built from host data, ...) around one step, with the code that is neither the loop's
nor the method's left uncounted (``_uncounted``): the transformers model's forward (transformers 5 reads a value
to detect packed sequences when no KV cache is used) and a reference package's own optimizer step. Counts are exact
integers (no tolerance): each comes from the code path, not from timing or the CPU.

1. ``train_step``: 0 host syncs with torch's fused AdamW (adamw, qlora: ``found_inf`` on the device; its step
   counted too), and exactly 1 besides the reference package's own step for every optimizer that cannot skip on the
   device (the one read of the grad norm).
2. A non-finite loss whose gradients are finite (a constant ``inf`` added to it) still skips the step on every
   method: weights and optimizer state unchanged, a non-finite grad norm and loss returned (the NaN backward seed).
3. ``StepTally`` equals the host bookkeeping it replaces (skipped count, bad streak, last loss, loss EMA bit for bit)
   on a random sequence of good and bad steps read at random steps.
4. ``run_training``: every step that is not a read step (logging, eval, checkpoint, last) makes 0 host syncs; a bad
   streak of ``max_bad_steps`` that ends between two reads still fails the run at the next read, naming its steps.
5. Two ranks (gloo, DDP and FSDP2 adamw): a non-finite loss on one rank only skips the step on both.
6. ``StepClock``'s CUDA path (a stand-in event class): no wait per step, one at the read.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from experiments.dispatch_counter import DispatchCounter

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import tiny_llama  # noqa: E402


def _uncounted(counter: DispatchCounter, obj, attr: str) -> None:
    """``obj.attr(...)`` runs with ``counter`` paused (code that is not the loop's or the method's)."""
    original = getattr(obj, attr)

    def paused(*args, **kwargs):
        counting, counter.counting = counter.counting, False
        try:
            return original(*args, **kwargs)
        finally:
            counter.counting = counting

    setattr(obj, attr, paused)


def _decoder(model: nn.Module) -> nn.Module:
    """The transformers decoder stack (``LlamaModel``) inside ``model`` and any wrapper: its forward builds the
    attention mask, which transformers 5 does with a host read (``find_packed_sequence_indices``) when no KV cache
    is used: the model's code, not the loop's."""
    return next(m for m in model.modules() if type(m).__name__ == "LlamaModel")


# (method config, host syncs of the step): 0 where torch's fused AdamW takes found_inf on the device (its step
# counted too), 1 where the driver reads the grad norm once to decide (baselines.driver.OptimizerDriver.step; the
# reference package's own step uncounted)
FUSED = ("adamw", "qlora")
CASES = {
    "adamw": ({"name": "adamw"}, 0),
    "qlora": ({"name": "qlora", "lora_r": 4, "compute_dtype": "fp32"}, 0),
    "adamw-foreach": ({"name": "adamw", "impl": "foreach"}, 1),
    "adamw-master": ({"name": "adamw", "master_weights": True}, 1),
    "adamw8bit": ({"name": "adamw", "eight_bit": True}, 1),
    "galore": ({"name": "galore", "rank": 8, "update_proj_gap": 2}, 1),
    "apollo": ({"name": "apollo", "rank": 8, "update_proj_gap": 2}, 1),
}


def _method_and_model(raw: dict):
    from experiments import methods

    model = tiny_llama()
    model.config.use_cache = False  # as experiments.models builds every model (a KV cache is built from host data)
    method = methods.make_method(methods.make_config(dict(raw)))
    model = method.prepare(model)
    method.attach(model, max_grad_norm=1.0)
    method.set_lr_scale(1.0)
    return model, method


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def _step(model, method, micro: list[torch.Tensor], *, fused_ce: bool = True):
    """``fused_ce=False``: the model's own ``labels=`` loss (transformers' loss reads a value to the host itself)."""
    from experiments.loop import train_step

    return train_step(model, method, micro, meter=None, autocast=contextlib.nullcontext, skip_nonfinite=True,
                      fused_ce=fused_ce)


@pytest.mark.parametrize("case", CASES)
def test_train_step_syncs_outside_the_optimizer(case):
    raw, expected = CASES[case]
    model, method = _method_and_model(raw)
    _step(model, method, [_ids(0), _ids(1)])  # step 0 creates the optimizer state lazily
    counter = DispatchCounter()
    if case not in FUSED:
        _uncounted(counter, method.driver.optimizer, "step")
    _uncounted(counter, _decoder(model), "forward")
    for step in (1, 2):  # a galore/apollo basis refresh (gap 2) at step 2, none at step 1
        counter.reset()
        with counter:
            _, norm = _step(model, method, [_ids(2 * step), _ids(2 * step + 1)])
        report = counter.report()
        print(f"{case} step {step}: {report.host_syncs} host syncs at {report.sync_sites}")
        assert report.host_syncs == expected, (case, step, report.sync_sites)
        assert isinstance(norm, torch.Tensor) and norm.shape == () and norm.dtype == torch.float32, norm


class _InfLoss(nn.Module):
    """``model``'s loss plus a constant ``inf`` on the chosen calls: a non-finite loss whose gradients are finite
    (d(loss + c)/d(loss) = 1), so only the loop's NaN backward seed can make the method skip the step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.poison = model, False

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        loss = self.model(input_ids=input_ids, labels=labels).loss
        return SimpleNamespace(loss=loss + float("inf") if self.poison else loss)


def _snapshot(model: nn.Module, method) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *method.state_tensors())]


def _changed(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)]


@pytest.mark.parametrize("case", CASES)
def test_a_nonfinite_loss_with_finite_gradients_skips_the_step(case):
    model, method = _method_and_model(CASES[case][0])
    wrapped = _InfLoss(model)
    _step(wrapped, method, [_ids(0), _ids(1)], fused_ce=False)  # optimizer state exists
    before = _snapshot(model, method)
    wrapped.poison = True
    loss, norm = _step(wrapped, method, [_ids(2), _ids(3)], fused_ce=False)
    wrapped.poison = False
    assert not torch.isfinite(loss) and not torch.isfinite(norm), (case, loss, norm)
    changed = _changed(before, _snapshot(model, method))
    assert not changed, f"{case}: tensors {changed} changed in a skipped step"
    loss, norm = _step(wrapped, method, [_ids(4), _ids(5)], fused_ce=False)
    assert torch.isfinite(loss) and torch.isfinite(norm), (case, loss, norm)
    assert _changed(before, _snapshot(model, method)), f"{case}: the next good step updated nothing"


# ------------------------------------------------------------------------------------------------- StepTally
def _host_reference(events, max_bad: int) -> dict:
    """The loop's former host bookkeeping (``experiments.loop`` before the tally), step by step."""
    skipped = in_row = 0
    last, ema, tripped = float("nan"), None, None
    for step, (loss, norm) in enumerate(events):
        bad = loss != loss or abs(loss) == float("inf") or not (norm == norm and abs(norm) != float("inf"))
        if bad:
            skipped, in_row = skipped + 1, in_row + 1
        else:
            in_row, last = 0, loss
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        if in_row >= max_bad and tripped is None:
            tripped = step
    return {"skipped": skipped, "in_row": in_row, "last": last, "ema": ema, "tripped": tripped}


def test_step_tally_equals_the_host_bookkeeping():
    from experiments.checkpoint.manager import LoopState
    from experiments.step_tally import StepTally

    rng = random.Random(3)
    values = [float("nan"), float("inf"), -float("inf")]
    events = []
    for _ in range(200):
        loss = rng.uniform(1, 10) if rng.random() > 0.2 else rng.choice(values)
        norm = rng.uniform(0, 5) if rng.random() > 0.2 else rng.choice(values)
        events.append((loss, norm))
    events[50:55] = [(float("nan"), 1.0)] * 5  # a streak of 5: trips max_bad_steps=4
    state = LoopState()
    tally = StepTally(state, torch.device("cpu"), max_bad_steps=4)
    for step, (loss, norm) in enumerate(events):
        tally.add(torch.tensor(loss, dtype=torch.float32), torch.tensor(norm, dtype=torch.float32))
        if rng.random() < 0.2 or step == len(events) - 1:
            reading = tally.read(state)
            # the references see the fp32 values the tensors hold (the loss is an fp32 tensor in the loop)
            ref = _host_reference([(float(torch.tensor(a, dtype=torch.float32)), b) for a, b in events[:step + 1]],
                                  4)
            got = {"skipped": state.skipped_steps, "in_row": state.bad_in_row, "last": state.last_loss,
                   "ema": state.loss_ema, "tripped": reading.tripped_at}
            same = {k: (got[k] == ref[k]) or (got[k] != got[k] and ref[k] != ref[k]) for k in ref}
            assert all(same.values()), (step, got, ref)
            assert reading.skipped == (events[step][0] != events[step][0] or abs(events[step][0]) == float("inf")
                                       or not abs(events[step][1]) < float("inf")), (step, reading)
    assert state.skipped_steps > 0 and reading.tripped_at == 53  # steps 50..53 are the first 4 in a row


def test_step_tally_resumes_from_a_loop_state():
    from experiments.checkpoint.manager import LoopState
    from experiments.step_tally import StepTally

    state = LoopState(next_step=7, last_loss=2.5, loss_ema=3.0, skipped_steps=2, bad_in_row=1)
    tally = StepTally(state, torch.device("cpu"), max_bad_steps=2)
    tally.add(torch.tensor(float("nan")), torch.tensor(1.0))
    reading = tally.read(state)
    assert (state.skipped_steps, state.bad_in_row, reading.tripped_at) == (3, 2, 7), (state, reading)
    assert (state.last_loss, state.loss_ema) == (2.5, 3.0), state


# ---------------------------------------------------------------------------------------------- run_training
def test_run_training_syncs_only_on_read_steps(tmp_path):
    from experiments import methods
    from experiments.checkpoint.manager import Checkpointer
    from experiments.config import TrainConfig
    from experiments.data.corpus import build_corpus
    from experiments.loop import run_training
    from experiments.memory.meter import MemoryMeter
    from experiments.models import build_model
    from test_faults import MICRO_MODEL

    cfg = TrainConfig(steps=9, seq_len=32, batch_size=2, warmup_steps=1, log_every=4, eval_every=100,
                      eval_batches=1, progress=False, checkpoint_every=3)
    torch.manual_seed(0)
    corpus = build_corpus(path=None, text_field="text", val_fraction=0.05, vocab_size=512, seq_len=32, batch_size=2,
                          seed=0, cache_dir="~/.cache/hmt")
    model = build_model(MICRO_MODEL, vocab_size=corpus.vocab_size)
    method = methods.make_method(methods.make_config({"name": "adamw"}))
    method.attach(model, max_grad_norm=1.0)
    counter, per_step, mark = DispatchCounter(), [], {"at": 0}
    _uncounted(counter, _decoder(model), "forward")
    original_batch, original_lr = corpus.train.batch, method.set_lr_scale

    def batch(index):  # built on the host from host tensors (a sampler's int(), numpy), then copied to the device
        with counter.phase("data"):
            return original_batch(index)

    def set_lr_scale(scale):  # called first in every step: the counts since the previous call are one step's
        total = counter.report().host_syncs
        per_step.append(total - mark["at"])
        mark["at"] = total
        original_lr(scale)

    corpus.train.batch, method.set_lr_scale = batch, set_lr_scale
    ck = Checkpointer(tmp_path / "ck", every=cfg.checkpoint_every, keep=0, model=model, method=method, meta={})
    with counter:
        run_training(model, method, corpus, cfg, torch.device("cpu"), log=lambda r: None, meter=MemoryMeter(),
                     checkpointer=ck)
    report = counter.report()
    per_step = per_step[1:] + [report.host_syncs - mark["at"]]  # per_step[k]: step k (its read included)
    read_steps = {0, 4, 8} | {2, 5}  # log_every=4 (and the last step); checkpoints after steps 3 and 6
    quiet = {k: n for k, n in enumerate(per_step) if k not in read_steps}
    print("host syncs per step (loop and method):", per_step, "at", report.sync_sites)
    assert len(per_step) == cfg.steps and all(n == 0 for n in quiet.values()), quiet


def test_a_bad_streak_between_reads_fails_the_run_at_the_next_read(tmp_path):
    from experiments.checkpoint.manager import TooManyBadSteps
    from test_faults import _train

    err, _, rows = _train(tmp_path, {"name": "adamw"}, steps=8, nan_loss={1, 2, 3}, max_bad_steps=3, log_every=5)
    assert isinstance(err, TooManyBadSteps), err
    assert "3 consecutive steps with a non-finite loss or gradient (steps 1..3" in str(err), str(err)
    assert [r["step"] for r in rows] == [0, 5] and rows[1]["skipped_steps"] == 3, rows  # failed at the read


# -------------------------------------------------------------------------------------------- two ranks (gloo)
def _dist_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from experiments import methods
    from experiments.dist import parallel as distributed
    from experiments.dist.parallel import DistContext
    from helpers import join_gloo, seeded_token_batches

    join_gloo(rank, world, port)
    try:
        results = {}
        x = seeded_token_batches(2)
        rows = x[0].shape[0] // world
        for mode in ("ddp", "fsdp2"):
            ctx = DistContext(mode=mode, rank=rank, world_size=world, local_rank=rank, backend="gloo",
                              device=torch.device("cpu"))
            model = tiny_llama()
            model.config.use_cache = False
            model = distributed.shard_model(model, ctx)
            method = methods.make_method(methods.make_config({"name": "adamw"}))
            method.attach(model, max_grad_norm=1.0)
            method.set_lr_scale(1.0)
            forward = _InfLoss(distributed.wrap_for_forward(model, method, ctx))
            _step(forward, method, [x[0][rank * rows:(rank + 1) * rows]], fused_ce=False)
            before = [p.detach().clone() for p in model.parameters()]
            forward.poison = rank == 1  # one rank's loss only
            loss, norm = _step(forward, method, [x[1][rank * rows:(rank + 1) * rows]], fused_ce=False)
            after = [p.detach().clone() for p in model.parameters()]
            results[mode] = {"loss_finite": bool(torch.isfinite(loss)), "norm_finite": bool(torch.isfinite(norm)),
                             "changed": sum(not torch.equal(a, b) for a, b in zip(before, after))}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    from test_distributed import spawn_pair

    got = spawn_pair(_dist_worker, tmp_path)
    for rank, results in got.items():
        for mode, r in results.items():
            assert r == {"loss_finite": rank == 0, "norm_finite": False, "changed": 0}, (rank, mode, r)


def test_step_clock_reads_cuda_events_once_per_read(monkeypatch):
    """The CUDA path of ``StepClock`` with a stand-in for ``torch.cuda.Event`` (this machine has no GPU): one pair
    of events per step, nothing waited on until ``read``, which waits on the last event only and converts each
    pair's milliseconds to seconds, in step order."""
    from experiments.step_tally import StepClock

    log = []

    class Event:
        clock = 0.0

        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            Event.clock += 1.5  # ms
            self.at = Event.clock

        def synchronize(self) -> None:
            log.append(("synchronize", self.at))

        def elapsed_time(self, end: "Event") -> float:
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = StepClock(torch.device("cuda", 0))
    for _ in range(3):
        clock.start()
        clock.stop()
    assert log == [], log  # no wait while stepping
    assert clock.read() == [0.0015, 0.0015, 0.0015]
    assert log == [("synchronize", 9.0)], log  # the last step's end event only
    assert clock.read() == [] and clock.pending == []
