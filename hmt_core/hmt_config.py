"""The ``hmt`` method's configuration (``method.*`` keys): the ``Config`` dataclass, its validation (one-line
``ValueError`` messages naming the key), and the typed optimizer settings built from it once
(``hmt_core.optim.settings``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from hmt_core.kernels import BACKENDS as KERNEL_BACKENDS
from hmt_core.optim.head_update import config_error as head_update_config_error
from hmt_core.optim.row_adam import VARIANTS as EMBEDDING_UPDATES
from hmt_core.optim.sharded import sharded_config_error
from hmt_core.optim.settings import Mode, OptimizerSettings, Precision, Projection, RefreshSchedule, UpdateRule
from hmt_core.optim.update import MOMENT_POLICIES, STYLES
from hmt_core.projection import SIDES, SOURCES
from hmt_core.rank import FALLBACKS
from hmt_core.rank_budget import normalize_state_budget
from hmt_core.selection import DEFAULT_PATTERNS
from hmt_core.streaming import OFFLOADS as WEIGHT_OFFLOADS
from hmt_core.streaming import config_error as weight_offload_error

MODES = tuple(mode.value for mode in Mode)  # method.mode's letters: "A", "B"


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "hmt"
    fsdp2: ClassVar[bool] = True  # its sharded engine steps FSDP2's row shards (hmt_core.optim.sharded)
    mode: str = "A"  # "A": low-rank AdamW; "B": APOLLO scaling
    lr: float = 1e-2  # GaLore/APOLLO's default LR for projected training
    # the input embedding's rate (a tied table's too) = lr × this: μP keeps an input layer's Adam rate constant in
    # the width while the matrices' falls as 1/width (Yang et al., 2022, Tensor Programs V, Table 3)
    embedding_lr_scale: float = 1.0
    # the rate of the one-dimensional parameters (norm gains, biases) = lr × this: μP's vector-like parameters,
    # whose Adam rate is constant in the width too (Tensor Programs V, Table 3: "input weights & all biases")
    vector_lr_scale: float = 1.0
    # the untied LM head's rate = lr × this (μP's output layer falls as 1/fan_in like the matrices; a separate key
    # to try other matrix rates with the head held); a tied head is the table (``embedding_lr_scale``)
    head_lr_scale: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_style: str = "torch"  # "torch" (torch.optim.AdamW) | "hf" (galore-/apollo-torch's AdamW formula)
    scale: float = 0.25  # α; Mode B multiplies by √scale like apollo-torch (APOLLO: 1, Mini: 128)
    sides: str = "one_sided"  # "one_sided" | "two_sided" | "identity" (full rank, Ĝ = G)
    basis: str = "rsvd"  # "svd" | "rsvd" | "random"
    rank: int | None = None  # fixed rank; None = dynamic
    rank_candidates: tuple[int, ...] = (32, 64, 128, 256)
    attn_candidates: tuple[int, ...] | None = None  # per-layer-type priors (names matching attn_pattern)
    mlp_candidates: tuple[int, ...] | None = None
    attn_pattern: str = "attn"
    mlp_pattern: str = "mlp"
    tau: float = 0.95
    rank_fallback: str = "largest"  # "largest" candidate | "full" = min(out, in)
    update_interval: int = 200
    power_iters: int = 2
    oversample: int = 8
    moment_policy: str = "keep"  # "keep" (GaLore) | "project" | "reset"
    state_dtype: str = "fp32"  # "fp32" | "bf16": the projected (low-rank) moments
    # moments of the dense parameters (embeddings, norms, lm_head): "weight" = bf16 for a bf16 weight, as
    # torch.optim.AdamW, galore-torch and apollo-torch keep them, else fp32 | "fp32" | "bf16"
    dense_state_dtype: str = "weight"
    scaling: str = "channel"  # Mode B: "channel" | "tensor"
    norm_limiter: bool = True
    limiter_gamma: float = 1.01
    target_patterns: tuple[str, ...] = DEFAULT_PATTERNS
    dense_8bit: bool = False
    per_layer: bool = True
    seed: int = 0
    offload_bases: bool = False  # park bases in host memory between uses (hmt_core.basis_cache; per_layer only)
    basis_cache_mib: int = 4096  # host budget for parked (current + previous) bases
    kernels: str = "auto"  # "auto" (Triton on CUDA when installed, else PyTorch) | "triton" | "torch"
    master_weights: bool = False  # fp32 copy of each low-precision weight takes the updates (hmt_core.precision)
    stochastic_rounding: bool = False  # BF16 weights written by stochastic rounding of the fp32 result
    random_rank: str = "captured"  # basis=random, dynamic rank: "captured" (by the bases) | "spectrum" (legacy)
    weight_dtype: str = "bf16"  # "bf16": projected weights keep the model's dtype | "int8" (hmt_core.int8_weights)
    # "bf16": the input embedding and the LM head keep the model's dtype | "int8": both stored as INT8 codes + block
    # scales and updated by stochastic rounding, whether projected or dense (hmt_core.int8_weights.embedding)
    embedding_dtype: str = "bf16"
    # dynamic rank: cap on the projected optimizer state (hmt_core.rank_budget): "galore" (GaLore's state at its
    # default rank), a fraction of AdamW's state ("0.25"), bytes ("3GiB", "500MB", "123456"), or None
    state_budget: str | None = "galore"
    # the input embedding's update (hmt_core.sparse_embedding): "dense" (a (V, d) gradient, AdamW) | "lazy_exact"
    # (the touched rows' gradient; dense AdamW caught up lazily per row) | "sparse_adam" (torch.optim.SparseAdam's rule)
    embedding_update: str = "dense"
    # the LM head's update: "dense" (a (V, d) gradient, updated in its hook) | "in_loss" (by vocabulary block inside
    # the fused loss's backward, no (V, d) gradient: hmt_core.optim.head_update; Mode B, random basis, fixed rank)
    head_update: str = "dense"
    # "none": every weight on the device | "host": the decoder layers' projected weights in host memory, on the
    # device only while their layer computes and is updated (hmt_core.streaming; docs/weight_streaming.md)
    weight_offload: str = "none"

    def __post_init__(self) -> None:
        for key in ("rank_candidates", "attn_candidates", "mlp_candidates", "target_patterns"):  # YAML lists
            value = getattr(self, key)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, key, tuple(value))
        check_choices(self)
        object.__setattr__(self, "state_budget", normalize_state_budget(self.state_budget))
        check_ranges(self)
        check_combinations(self)

    def rank_candidates_for(self, name: str) -> tuple[int, ...]:
        """The ranks the allocator may give weight ``name``: the attention or MLP prior where its name matches
        ``attn_pattern`` / ``mlp_pattern`` and one is set, else ``rank_candidates``."""
        if self.attn_candidates is not None and re.search(self.attn_pattern, name):
            return tuple(int(r) for r in self.attn_candidates)
        if self.mlp_candidates is not None and re.search(self.mlp_pattern, name):
            return tuple(int(r) for r in self.mlp_candidates)
        return tuple(int(r) for r in self.rank_candidates)

    def check(self, run: Any) -> None:
        """``head_update=in_loss`` updates the LM head inside the fused loss's backward: one micro-batch, one
        process (``hmt_core.method.MethodConfig``)."""
        if self.head_update == "in_loss":
            clash = ("train.fused_ce=false" if not run.train.fused_ce
                     else f"train.grad_accum={run.train.grad_accum}" if run.train.grad_accum > 1
                     else f"dist={run.dist.mode}" if run.dist.mode != "none" else None)
            if clash:
                raise ValueError(f"method.head_update=in_loss updates the LM head inside the fused loss's backward, "
                                 f"one micro-batch, one process; it cannot be combined with {clash}")

    def dist_error(self, dist: Any) -> str | None:
        """The distributed sketch (``dist.refresh=sketch``) is the randomized SVD's, of one side; FSDP2 runs the
        sharded engine (``hmt_core.optim.sharded``); ``dist.lowrank_comm`` all-reduces per-layer Mode A's Ĝ."""
        if dist.refresh != "gather" and self.basis != "rsvd":
            return (f"dist.refresh={dist.refresh} needs method=hmt with method.basis=rsvd (got "
                    f"method.basis={self.basis}): the distributed sketch is the randomized SVD's; use "
                    "dist.refresh=gather")
        if dist.refresh != "gather" and self.sides != "one_sided":
            return (f"dist.refresh={dist.refresh} needs method.sides=one_sided (got method.sides={self.sides}): "
                    "the distributed sketch keeps one side's basis; use dist.refresh=gather")
        if dist.mode == "fsdp2":
            why = sharded_config_error(self)
            if why is None and dist.lowrank_comm:
                why = "dist.lowrank_comm=true is not supported with dist=fsdp2 (a left-sided Ĝ is already all-reduced)"
            return why
        if dist.lowrank_comm and not (self.per_layer and self.mode == "A"):
            return (f"dist.lowrank_comm=true needs method=hmt with per_layer=true and mode=A (got hmt with "
                    f"per_layer={self.per_layer}, mode={self.mode}): only per-layer Mode A projects a gradient "
                    "before it is reduced")
        return None


def check_choices(c: Config) -> None:
    """Every enumerated key is one of its options, and the embedding's / head's update fits the rest."""
    for key, options in (("mode", MODES), ("adam_style", STYLES), ("sides", SIDES), ("basis", SOURCES),
                         ("rank_fallback", FALLBACKS), ("moment_policy", MOMENT_POLICIES),
                         ("state_dtype", ("fp32", "bf16")), ("dense_state_dtype", ("weight", "fp32", "bf16")),
                         ("kernels", KERNEL_BACKENDS), ("scaling", ("channel", "tensor")),
                         ("random_rank", ("captured", "spectrum")), ("weight_dtype", ("bf16", "int8")),
                         ("embedding_dtype", ("bf16", "int8")), ("embedding_update", EMBEDDING_UPDATES),
                         ("head_update", ("dense", "in_loss")), ("weight_offload", WEIGHT_OFFLOADS)):
        if getattr(c, key) not in options:
            raise ValueError(f"method.{key} must be one of {options}, got {getattr(c, key)!r}")
    if c.head_update == "in_loss" and head_update_config_error(c):
        raise ValueError(f"method.head_update=in_loss: {head_update_config_error(c)}")
    if c.embedding_update != "dense":
        clash = ("method.per_layer=false" if not c.per_layer
                 else "method.master_weights=true" if c.master_weights
                 else "method.stochastic_rounding=true" if c.stochastic_rounding else None)
        if clash:
            raise ValueError(f"method.embedding_update={c.embedding_update} updates the embedding's rows inside "
                             f"backward with its own moments; it cannot be combined with {clash}")


def check_ranges(c: Config) -> None:
    """Every numeric key is in its range."""
    if not c.lr > 0:
        raise ValueError(f"method.lr must be > 0, got {c.lr}")
    for key in ("embedding_lr_scale", "vector_lr_scale", "head_lr_scale"):
        if not getattr(c, key) > 0:
            raise ValueError(f"method.{key} must be > 0, got {getattr(c, key)}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(c, key) < 1:
            raise ValueError(f"method.{key} must be in [0, 1), got {getattr(c, key)}")
    if not c.eps > 0:
        raise ValueError(f"method.eps must be > 0, got {c.eps}")
    if c.weight_decay < 0:
        raise ValueError(f"method.weight_decay must be >= 0, got {c.weight_decay}")
    if not c.scale > 0:
        raise ValueError(f"method.scale must be > 0, got {c.scale}")
    if c.rank is not None and c.rank <= 0:
        raise ValueError(f"method.rank must be a positive integer or None (dynamic), got {c.rank}")
    for key in ("rank_candidates", "attn_candidates", "mlp_candidates"):
        value = getattr(c, key)
        if value is not None and (len(value) == 0 or any(int(r) <= 0 for r in value)):
            raise ValueError(f"method.{key} must be a non-empty tuple of positive ranks, got {value}")
    if not 0 < c.tau <= 1:
        raise ValueError(f"method.tau must be in (0, 1], got {c.tau}")
    if c.update_interval <= 0:
        raise ValueError(f"method.update_interval must be > 0, got {c.update_interval}")
    if c.power_iters < 0 or c.oversample < 0:
        raise ValueError(f"method.power_iters and method.oversample must be >= 0, got "
                         f"{c.power_iters}, {c.oversample}")
    if c.limiter_gamma < 1:
        raise ValueError(f"method.limiter_gamma must be >= 1, got {c.limiter_gamma}")


def check_combinations(c: Config) -> None:
    """Keys that exclude each other, the basis cache's budget and the target patterns."""
    if c.mode == "B" and c.sides == "two_sided" and c.scaling == "channel":
        raise ValueError("method.scaling='channel' needs one-sided projection in mode B; use 'tensor'")
    if c.master_weights and c.stochastic_rounding:
        raise ValueError("method.master_weights and method.stochastic_rounding are alternatives: choose one")
    if c.dense_8bit and (c.master_weights or c.stochastic_rounding):
        raise ValueError("method.dense_8bit=true (bitsandbytes AdamW8bit writes the weights itself) cannot be "
                         "combined with method.master_weights or method.stochastic_rounding")
    for key in ("weight_dtype", "embedding_dtype"):
        if getattr(c, key) == "int8" and c.master_weights:
            raise ValueError(f"method.{key}=int8 writes its updates by stochastic rounding; "
                             "method.master_weights=true (an fp32 copy of every weight) would defeat it")
    if c.weight_offload == "host":
        why = weight_offload_error(per_layer=c.per_layer, master_weights=c.master_weights)
        if why:
            raise ValueError(f"method.weight_offload=host cannot be combined: {why}")
    if c.offload_bases and not c.per_layer:
        raise ValueError("method.offload_bases=true needs method.per_layer=true")
    if c.basis_cache_mib <= 0:
        raise ValueError(f"method.basis_cache_mib must be > 0, got {c.basis_cache_mib}")
    if not c.target_patterns:
        raise ValueError("method.target_patterns must name at least one pattern")
    for pattern in (*c.target_patterns, c.attn_pattern, c.mlp_pattern):
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"method.target_patterns: invalid regular expression {pattern!r}: {err}") from None


def optimizer_settings(c: Config) -> OptimizerSettings:
    """The keys ``LowRankOptimizer`` reads, grouped by what they decide."""
    return OptimizerSettings(
        rule=UpdateRule(mode=Mode(c.mode), lr=c.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                        weight_decay=c.weight_decay, adam_style=c.adam_style, scale=c.scale, scaling=c.scaling,
                        norm_limiter=c.norm_limiter, limiter_gamma=c.limiter_gamma, dense_8bit=c.dense_8bit),
        projection=Projection(sides=c.sides, basis=c.basis, rank=c.rank, tau=c.tau, rank_fallback=c.rank_fallback,
                              random_rank=c.random_rank, power_iters=c.power_iters, oversample=c.oversample,
                              state_budget=c.state_budget),
        schedule=RefreshSchedule(update_interval=c.update_interval, moment_policy=c.moment_policy),
        precision=Precision(state_dtype=c.state_dtype, dense_state_dtype=c.dense_state_dtype,
                            master_weights=c.master_weights, stochastic_rounding=c.stochastic_rounding,
                            kernels=c.kernels),
        seed=c.seed)
