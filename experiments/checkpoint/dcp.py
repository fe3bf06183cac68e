"""Checkpoints of multi-process runs through ``torch.distributed.checkpoint`` (DCP), in the single-process layout.

A checkpoint is ``<root>/step-NNNNNNNN/`` holding DCP's files (``.metadata`` and one ``__<rank>_0.distcp`` per
writing rank) plus ``manifest.json`` (the step, the run's config, each file's size and SHA-256), so
``experiments.checkpoint.store.verify``/``find_latest_good`` and ``experiments.checkpoint.manager.find_resume`` (config check,
damaged-checkpoint fallback) work unchanged. Atomicity: every rank writes into ``<root>/.tmp-step-NNNNNNNN``
(``dcp.save`` is collective and returns once ``.metadata`` is written); rank 0 then hashes the files, writes the
manifest and renames the directory to ``step-...``; a job killed before that leaves only a temp directory, which
the next save removes.

What is saved (one state dict, each entry through DCP):
- ``model``: ``get_model_state_dict`` (plain tensors under DDP, DTensor shards under FSDP2: each rank writes its
  shard; replicated tensors are written once);
- ``optim``: ``get_optimizer_state_dict`` for torch's AdamW (sharded with the weights under FSDP2);
- ``method``: every other method's own ``state_dict()`` (hmt bases and low-rank moments, galore-torch/apollo-torch
  optimizer state with their projector objects), one serialized entry: it is identical on every rank (each rank
  computes the same update from the all-reduced gradient), so DCP writes it once; under FSDP2 galore-torch's and
  apollo-torch's state holds DTensors (also inside projector objects), gathered to full values first
  (``experiments.checkpoint.dtensor_state``) and put back on the reading run's mesh;
- ``hmt_rows`` (FSDP2 + hmt only, ``hmt_core.optim.sharded_state``): the moments that are row shards of a
  parameter (right-sided and dense ones) as ``Shard(0)`` DTensors of their global shape, each rank writing its rows;
  ``method`` then holds placeholders in their place. Restoring reads ``method`` first, builds this rank's empty
  shards from the placeholders and reads ``hmt_rows`` into them (two ``dcp.load`` calls, both collective);
- ``loop``: the loop state, the driver's base learning rates and the random generators (also identical on every
  rank: all draw the same numbers; data batches come from their own generator).
Loading reads them back into this process's model/optimizer with ``set_model_state_dict`` /
``set_optimizer_state_dict``.

Another world size (``check_resume``; the manifest records the writer's ``dist.world_size``). The global batch is
the same for every W (rank r takes rows [r·B/W, (r+1)·B/W)), so only the state's layout depends on W, and DCP
reads every tensor by its global offsets (``torch.distributed.checkpoint`` load planner: a saved shard is copied
into whichever of this run's shards overlap it): DTensor shards (FSDP2 weights and AdamW moments, hmt's
``hmt_rows``) are resharded to the new W; plain tensors and the serialized ``method``/``loop`` entries are the same
on every rank, so any W reads them whole. A resumed step at another W then differs from the uninterrupted one only
in the order its gradient's terms are summed (``tests/test_dist_resume.py`` measures it). State that is per rank
and not a DTensor cannot be resharded: ``PER_RANK_STATE`` names it, and such a checkpoint is refused at another
world size with one line.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from baselines.driver import restore_base_lrs
from experiments.checkpoint import dtensor_state
from experiments.checkpoint.manager import Checkpointer, LoopState, Preempted, ResumePoint
from experiments.errors import UserError
from experiments.checkpoint import store as ck
from hmt_core.method import Method
from hmt_core.optim import sharded_state


PAUSE_SEALED_ENV = "HMT_DIST_CHECKPOINT_PAUSE_S"
# (dist mode, method name) -> why its checkpoint state is per rank (not resharded by DCP); empty: every supported
# combination reshards (DDP: all state is replicated; FSDP2: DTensor shards, see the module docstring)
PER_RANK_STATE: dict[tuple[str, str], str] = {}


def torch_optimizer(method: Method) -> torch.optim.Optimizer | None:
    """The method's optimizer when it is torch's own AdamW (saved through ``get_optimizer_state_dict``)."""
    opt = method.torch_optimizer()
    return opt if type(opt) is torch.optim.AdamW else None


def _blob(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _unblob(buf: io.BytesIO, device: torch.device):
    buf.seek(0)
    return torch.load(buf, map_location=device, weights_only=False)


class PreemptFlag:
    """A host flag (a preemption signal arrived) that every rank agrees on without a host-device synchronization:
    each ``poll`` waits for the MAX all-reduce that the previous ``poll`` started asynchronously and starts the next
    one with this rank's flag. The flag is a CPU tensor on a gloo group of its own, so neither touches the device
    (a flag on the NCCL group would need a copy and a read that wait for the step's kernels). Every rank polls once
    per step at the same point, so every rank sees the same value at the same step, one step after the signal."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")  # collective
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self.agreed = False  # once True, it stays (no more all-reduces)

    def poll(self, value: bool) -> bool:
        if not self.agreed:
            self.agreed = self._wait()
        if not self.agreed:
            flag = torch.full((1,), float(value))  # CPU
            self._pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag
        return self.agreed

    def _wait(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag.item())  # a CPU tensor: no device synchronization

    def close(self) -> None:
        """Wait for the outstanding all-reduce (its value no longer matters)."""
        self._wait()


class DistCheckpointer(Checkpointer):
    """``Checkpointer`` whose save/restore are collective DCP calls; preemption flags are agreed across ranks."""

    def __init__(self, root: Path, *, every: int, keep: int, model, method, meta: dict, ctx) -> None:
        self.ctx = ctx
        self._flag: PreemptFlag | None = None  # made by the first ``preempt_requested``
        if not ctx.is_main:
            ctx.barrier()  # rank 0 creates the directory and probes it first
        super().__init__(root, every=every, keep=keep, model=model, method=method, meta=meta)
        # test hook: every rank sleeps this long after each complete checkpoint (to kill a rank in between)
        self.pause_sealed_s = float(os.environ.get(PAUSE_SEALED_ENV, "0") or 0)
        if ctx.is_main:
            ctx.barrier()

    # ---- state ----------------------------------------------------------------------------------------------
    def _state_dict(self, state: LoopState | None) -> dict:
        opt = torch_optimizer(self.method)  # its groups carry the base rates (initial_lr)
        loop = None if state is None else {"state": dataclasses.asdict(state), "rng": ck.rng_state()}
        sd = {"model": get_model_state_dict(self.model), "loop": _blob(loop) if loop is not None else io.BytesIO()}
        if opt is not None:
            sd["optim"] = get_optimizer_state_dict(self.model, opt)
        elif state is None:
            sd["method"] = io.BytesIO()
        elif self._row_slots() is not None:
            replicated, sd["hmt_rows"] = sharded_state.split_state(self.method.state_dict(), self._row_slots())
            sd["method"] = _blob(replicated)
        elif self.ctx.mode == "fsdp2":  # galore-torch/apollo-torch on DTensors: gathered, any world size reads it
            sd["method"] = _blob(dtensor_state.gather(self.method.state_dict()))
        else:
            sd["method"] = _blob(self.method.state_dict())
        return sd

    def _row_slots(self) -> list | None:
        """FSDP2: the method's slots whose moments are per-rank row shards (``Method.row_shard_slots``,
        ``hmt_core.optim.sharded_state``); None when its state is saved whole."""
        return self.method.row_shard_slots() if self.ctx.mode == "fsdp2" else None

    def _mesh(self):
        """The device mesh FSDP2 shards this model's parameters on."""
        from torch.distributed.tensor import DTensor

        return next(p.device_mesh for p in self.model.parameters() if isinstance(p, DTensor))

    def check_resume(self, point: ResumePoint) -> None:
        """A checkpoint written by another number of ranks: accepted where DCP reshards every entry, else one
        ``UserError`` line naming both world sizes (raised on every rank alike, before anything is written)."""
        saved = ((point.manifest.get("meta") or {}).get("dist") or {}).get("world_size")
        if saved is None or int(saved) == self.ctx.world_size:
            return
        why = self.per_rank_state()
        if why is not None:
            raise UserError(f"checkpoint {point.path} was written by {saved} ranks but this run has "
                            f"{self.ctx.world_size}: {why}; resume with {saved} ranks (torchrun --nproc_per_node, "
                            "or Slurm tasks), or start over with force=true or train.resume=never")

    def per_rank_state(self) -> str | None:
        """Why this run's checkpoint state cannot be read at another world size (None: DCP reshards all of it)."""
        for (mode, method), why in PER_RANK_STATE.items():
            if self.ctx.mode == mode and getattr(self.method, "name", None) == method:
                return why
        return None

    def restore(self, point: ResumePoint, device: torch.device) -> LoopState:
        with self.ctx.counted_as("checkpoint"):
            return self._restore(point, device)

    def _restore(self, point: ResumePoint, device: torch.device) -> LoopState:
        expected = point.manifest["meta"].get("frozen_fingerprint")
        if expected is not None and expected != self.fingerprint():
            raise ck.CheckpointError(f"{point.path}: the frozen (not checkpointed) weights differ from the ones "
                                     "this checkpoint was trained on (different seed, model.path or model?)")
        sd = self._state_dict(None)
        dcp.load(sd, checkpoint_id=str(point.path))
        set_model_state_dict(self.model, sd["model"])
        loop = _unblob(sd["loop"], device)
        opt = torch_optimizer(self.method)
        if opt is not None:
            set_optimizer_state_dict(self.model, opt, sd["optim"])
            restore_base_lrs(opt, loop.get("base_lrs"))  # a checkpoint from before the groups carried them
        else:
            method_state = _unblob(sd["method"], device)
            if self._row_slots() is not None:
                rows = sharded_state.row_templates(method_state, self._row_slots())
                if rows:
                    dcp.load({"hmt_rows": rows}, checkpoint_id=str(point.path))
                method_state = sharded_state.join_state(method_state, rows)
            elif self.ctx.mode == "fsdp2":
                method_state = dtensor_state.distribute(method_state, self._mesh())
            self.method.load_state_dict(method_state)
        ck.set_rng_state(loop["rng"])
        return LoopState(**loop["state"])

    # ---- save -----------------------------------------------------------------------------------------------
    def save(self, state: LoopState) -> ck.SavedCheckpoint:
        t0 = time.perf_counter()
        step = state.next_step
        tmp = self.root / f".tmp-{ck.step_dir_name(step)}"
        if self.ctx.is_main:
            ck._remove_leftovers(self.root)
            tmp.mkdir()
        self.ctx.barrier()
        with self.ctx.counted_as("checkpoint"):
            dcp.save(self._state_dict(state), checkpoint_id=str(tmp))
        final = self.root / ck.step_dir_name(step)
        sizes: dict[str, int] = {}
        if self.ctx.is_main:
            sizes = self._seal(tmp, final, step)
        self.ctx.barrier()
        if self.pause_sealed_s > 0:
            time.sleep(self.pause_sealed_s)
        saved = ck.SavedCheckpoint(final, int(step), sizes, time.perf_counter() - t0)
        record = {"step": saved.step, "path": str(saved.path), "bytes": saved.total_bytes,
                  "bytes_by_file": saved.bytes_by_file, "seconds": round(saved.seconds, 4)}
        self.saved.append(record)
        if self.ctx.is_main:
            print(f"checkpoint step {step} (DCP, {self.ctx.world_size} ranks): {saved.total_bytes / 2**20:.2f} MiB "
                  f"in {saved.seconds:.2f} s -> {final}", file=sys.stderr)
        return saved

    def _seal(self, tmp: Path, final: Path, step: int) -> dict[str, int]:
        """Rank 0: manifest (sizes + SHA-256 of every DCP file), fsync, rename into place, prune."""
        files = {p.name: {"bytes": p.stat().st_size, "sha256": ck.sha256_file(p)}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        meta = {**self.meta, "frozen_fingerprint": self.fingerprint(), "next_step": step,
                "dist": {"format": "torch.distributed.checkpoint", "world_size": self.ctx.world_size,
                         "mode": self.ctx.mode}}
        manifest = {"format": ck.FORMAT, "step": int(step), "files": files, "meta": meta}
        text = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
        with open(tmp / ck.MANIFEST, "wb") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        for p in tmp.iterdir():  # DCP's writer does not fsync
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            ck._discard(self.root, final)
        os.rename(tmp, final)
        if self.keep > 0:
            ck.prune(self.root, self.keep)
        return {**{name: info["bytes"] for name, info in files.items()}, ck.MANIFEST: len(text)}

    # ---- preemption -----------------------------------------------------------------------------------------
    def preempt_requested(self) -> bool:
        """True on every rank, at the same step, once any rank received a preemption signal (all checkpoint
        together): ``PreemptFlag`` agrees on the flag one step after it was raised, with no device work and no
        host wait for the device."""
        if self._flag is None:
            with self.ctx.counted_as("control"):
                self._flag = PreemptFlag()  # collective: the first call is at the same step on every rank
        with self.ctx.counted_as("control"):
            agreed = self._flag.poll(self.signal_received is not None)
        if agreed and self.signal_received is None:  # another rank got it: act as if this one had
            self.signal_received = signal.SIGTERM
        return agreed

    def stop_preempt_checks(self) -> None:
        if self._flag is not None:
            self._flag.close()

    def preempt(self, state: LoopState) -> None:
        """Every rank writes the checkpoint (collective); rank 0 alone asks Slurm to requeue the job, so a job of
        several tasks (``hydra.launcher.tasks_per_node``) is requeued once, not once per rank."""
        if self.ctx.is_main or self.signal_received == signal.SIGINT:
            super().preempt(state)
            return
        saved = self.save(state)
        raise Preempted(f"preempted by {signal.Signals(self.signal_received).name} after step {state.next_step}; "
                        f"checkpoint {saved.path} written; rank 0 requests the requeue")
