"""What a multi-process launch must agree on, checked before anything runs: ``dist``, torchrun's environment, the
world size, the method and its options (one ``UserError`` line each, raised on every rank alike). Used by
``experiments.dist.context.setup``, the per-rank dry run and the Slurm launcher (before it submits)."""

from __future__ import annotations

import os

import torch

from experiments import methods
from experiments.errors import UserError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH = "torchrun --nproc_per_node N -m experiments.run dist=ddp ..."


def torchrun_world_size() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def check_launch(run, device: torch.device) -> None:
    """Bad combinations of ``dist``, the launcher and the rest of the config, as one-line ``UserError``s."""
    mode, world = run.dist.mode, torchrun_world_size()
    check_refresh(run)
    if run.dist.world_size is not None and run.mode != "dryrun":
        raise UserError(f"dist.world_size={run.dist.world_size} is for mode=dryrun (one process tracing rank 0 of "
                        "a fake process group); a training run takes its world size from torchrun")
    if run.mode == "dryrun" and mode != "none" and world is None:
        if run.dist.world_size is None:
            raise UserError(f"mode=dryrun with dist={mode} needs dist.world_size=N (the world size to trace)")
        return check_combination(run, run.dist.world_size)
    if mode == "none":
        if world is not None and world > 1:
            raise UserError(f"launched with WORLD_SIZE={world} (torchrun) but dist=none: every rank would train "
                            "the same model alone and write the same results; add dist=ddp or dist=fsdp2")
        return
    missing = [k for k in TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        raise UserError(f"dist={mode} needs torchrun's environment ({', '.join(missing)} unset): launch with "
                        f"`{LAUNCH.replace('ddp', mode)}`")
    if run.mode != "train":
        raise UserError(f"dist={mode} with mode={run.mode}: multi-process runs train only (mode=dryrun is "
                        "one process; run it without torchrun, with dist.world_size=N)")
    backend = resolve_backend(run.dist.backend, device)
    if backend == "nccl" and device.type != "cuda":
        raise UserError(f"dist.backend=nccl needs CUDA (device={device.type}); use dist.backend=gloo or auto")
    check_combination(run, world)


def check_combination(run, world: int) -> None:
    """What ``dist``, ``world`` ranks and the rest of the config must agree on (training and dry run alike); what
    the method supports it says itself (``hmt_core.method.MethodConfig``: ``fsdp2``, ``dist_error``)."""
    mode, name = run.dist.mode, run.method.name
    if run.train.batch_size % world:
        source = "dist.world_size" if run.mode == "dryrun" else "WORLD_SIZE"
        raise UserError(f"train.batch_size={run.train.batch_size} (the global batch) is not divisible by "
                        f"{source}={world}: every rank takes an equal share")
    if mode == "fsdp2" and not run.method.fsdp2:
        raise UserError(f"dist=fsdp2 supports method={','.join(methods.fsdp2_names())}, got method={name}; "
                        "use dist=ddp")
    why = run.method.dist_error(run.dist)
    if why is not None:
        raise UserError(why)
    if mode == "fsdp2" and run.train.save_model:
        raise UserError("dist=fsdp2 with train.save_model=true is not supported (the weights are sharded); "
                        "use dist=ddp")


def check_refresh(run) -> None:
    """``dist.refresh=sketch``: a basis refresh on FSDP2's row shards, by a method whose settings allow it."""
    if run.dist.refresh == "gather":
        return
    if run.dist.mode != "fsdp2":
        raise UserError(f"dist.refresh={run.dist.refresh} needs dist=fsdp2 (got dist={run.dist.mode}): only FSDP2 "
                        "shards the gradient a basis refresh reads; drop dist.refresh")
    why = run.method.dist_error(run.dist)
    if why is not None:
        raise UserError(why)


def probe_skipped(mode: str) -> str:
    """Why ``mode=train``/``mode=dryrun`` skip the activation probe under ``dist=ddp|fsdp2`` (the policy is applied)."""
    return (f"dist={mode}: the activation probe is single-process (it runs forward and autograd.grad on one "
            "short sequence outside the training step, which FSDP2's hooks and DDP's reducer do not expect, on "
            "one rank) and its figures (saved bytes, codec errors, gradient agreement) do not depend on the world "
            "size; run the same config with dist=none to probe it")


def resolve_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    return "nccl" if device.type == "cuda" else "gloo"
