"""What a multi-process launch must agree on, checked before anything runs: ``dist``, torchrun's environment, the
world size, the method and its options (one ``UserError`` line each, raised on every rank alike). Used by
``experiments.dist.context.setup``, the per-rank dry run and the Slurm launcher (before it submits)."""

from __future__ import annotations

import os

import torch

from experiments.errors import UserError
from hmt_core.optim.sharded import sharded_config_error

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


# methods whose optimizer steps FSDP2's DTensor shards as is: torch AdamW, and galore-torch/apollo-torch through
# DTensor's operator dispatch (``experiments.dist.dtensor_state``); hmt has its own sharded engine
FSDP2_METHODS = ("adamw", "galore", "apollo")


def check_combination(run, world: int) -> None:
    """What ``dist``, ``world`` ranks and the rest of the config must agree on (training and dry run alike)."""
    mode, name = run.dist.mode, run.method.name
    if run.train.batch_size % world:
        source = "dist.world_size" if run.mode == "dryrun" else "WORLD_SIZE"
        raise UserError(f"train.batch_size={run.train.batch_size} (the global batch) is not divisible by "
                        f"{source}={world}: every rank takes an equal share")
    if mode == "fsdp2":
        if name == "hmt":
            check_fsdp2_hmt(run)
        elif name not in FSDP2_METHODS:
            raise UserError(f"dist=fsdp2 supports method={','.join(FSDP2_METHODS)} and hmt, got method={name}; "
                            "use dist=ddp")
        elif name == "adamw" and (run.method.master_weights or run.method.stochastic_rounding):
            raise UserError("dist=fsdp2 with method=adamw supports neither method.master_weights nor "
                            "method.stochastic_rounding (the fp32 copy is not sharded); use dist=ddp")
        elif name == "galore" and run.method.eight_bit:
            raise UserError("dist=fsdp2 with method=galore does not support method.eight_bit=true "
                            "(bitsandbytes' 8-bit state does not step DTensor shards); use dist=ddp")
        if run.train.save_model:
            raise UserError("dist=fsdp2 with train.save_model=true is not supported (the weights are sharded); "
                            "use dist=ddp")
    if run.dist.lowrank_comm:
        check_lowrank_comm(run.method)


def check_refresh(run) -> None:
    """``dist.refresh=sketch``: hmt's randomized-SVD refresh on FSDP2's row shards, nothing else."""
    if run.dist.refresh == "gather":
        return
    method = run.method
    if run.dist.mode != "fsdp2":
        raise UserError(f"dist.refresh={run.dist.refresh} needs dist=fsdp2 (got dist={run.dist.mode}): only FSDP2 "
                        "shards the gradient a basis refresh reads; drop dist.refresh")
    if method.name != "hmt" or method.basis != "rsvd":
        got = f"method={method.name}" if method.name != "hmt" else f"method.basis={method.basis}"
        raise UserError(f"dist.refresh={run.dist.refresh} needs method=hmt with method.basis=rsvd (got {got}): the "
                        "distributed sketch is the randomized SVD's; use dist.refresh=gather")
    if method.sides != "one_sided":
        raise UserError(f"dist.refresh={run.dist.refresh} needs method.sides=one_sided (got "
                        f"method.sides={method.sides}): the "
                        "distributed sketch keeps one side's basis; use dist.refresh=gather")


def probe_skipped(mode: str) -> str:
    """Why ``mode=train``/``mode=dryrun`` skip the activation probe under ``dist=ddp|fsdp2`` (the policy is applied)."""
    return (f"dist={mode}: the activation probe is single-process (it runs forward and autograd.grad on one "
            "short sequence outside the training step, which FSDP2's hooks and DDP's reducer do not expect, on "
            "one rank) and its figures (saved bytes, codec errors, gradient agreement) do not depend on the world "
            "size; run the same config with dist=none to probe it")


def check_fsdp2_hmt(run) -> None:
    """``dist=fsdp2`` + hmt: the per-layer engine on row shards (``hmt_core.optim.sharded``) and what it supports."""
    why = sharded_config_error(run.method)
    if why is None and run.dist.lowrank_comm:
        why = "dist.lowrank_comm=true is not supported with dist=fsdp2 (a left-sided Ĝ is already all-reduced)"
    if why is not None:
        raise UserError(why)


def check_lowrank_comm(method_cfg) -> None:
    """``dist.lowrank_comm`` needs per-layer HMT in Mode A (the only path that projects before reducing)."""
    name = method_cfg.name
    if name != "hmt" or not getattr(method_cfg, "per_layer", False) or getattr(method_cfg, "mode", "A") != "A":
        got = name if name != "hmt" else f"hmt with per_layer={method_cfg.per_layer}, mode={method_cfg.mode}"
        raise UserError(f"dist.lowrank_comm=true needs method=hmt with per_layer=true and mode=A (got {got}): "
                        "only per-layer Mode A projects a gradient before it is reduced")


def resolve_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    return "nccl" if device.type == "cuda" else "gloo"
