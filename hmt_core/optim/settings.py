"""The low-rank optimizer's settings: typed, frozen views of the ``hmt`` method's Config, built once by
``hmt_core.hmt_config.optimizer_settings`` and read by ``hmt_core.optim.optimizer.LowRankOptimizer``."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mode(enum.StrEnum):
    """How a projected weight is updated, parsed once from ``method.mode`` (its value, "A" | "B"; the configs, run ids
    and results keep the letter): ``hmt_core.optim.updaters`` maps it to the slot's updater."""

    LOW_RANK_ADAM = "A"  # AdamW on the projected gradient, written back through the basis (GaLore, Alg. 2)
    APOLLO_SCALING = "B"  # the low-rank moments scale the full gradient (APOLLO, Alg. 1)


@dataclass(frozen=True, kw_only=True)
class UpdateRule:
    """The update rule and its moments: AdamW (``adam_style`` torch | hf) on Ĝ (Mode A, GaLore Alg. 2) or APOLLO's
    scaling of G (Mode B, APOLLO Alg. 1), W ← W − lr·α·update."""

    mode: Mode
    lr: float  # the initial rate (``LowRankOptimizer.lr`` holds the scheduled one)
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_style: str
    scale: float  # α; Mode B multiplies by √α
    scaling: str  # Mode B: "channel" | "tensor"
    norm_limiter: bool  # Mode B
    limiter_gamma: float
    dense_8bit: bool  # dense weights: bitsandbytes' AdamW8bit (INT8 embedding: hmt_core.optim.moments8)


@dataclass(frozen=True, kw_only=True)
class Projection:
    """Where the basis comes from and its rank (``hmt_core.projection``, ``hmt_core.rank``, ``rank_budget``)."""

    sides: str  # "one_sided" | "two_sided" | "identity"
    basis: str  # "svd" | "rsvd" | "random"
    rank: int | None  # None: dynamic, E(r) ≥ tau
    tau: float
    rank_fallback: str
    random_rank: str  # basis=random, dynamic rank: "captured" | "spectrum"
    power_iters: int
    oversample: int
    state_budget: str | None  # normalized (``hmt_core.rank_budget.normalize_state_budget``)


@dataclass(frozen=True, kw_only=True)
class RefreshSchedule:
    """When a basis is refreshed (before updates 0, T, 2T, ...) and what its moments do then."""

    update_interval: int  # T
    moment_policy: str  # "keep" | "project" | "reset"


@dataclass(frozen=True, kw_only=True)
class Precision:
    """State dtypes, weight writes (``hmt_core.precision.UpdateWriter``) and the kernels backend."""

    state_dtype: str  # projected moments: "fp32" | "bf16"
    dense_state_dtype: str  # dense moments: "weight" (bf16 for a bf16 weight, else fp32) | "fp32" | "bf16"
    master_weights: bool
    stochastic_rounding: bool
    kernels: str  # "auto" | "triton" | "torch"


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    rule: UpdateRule
    projection: Projection
    schedule: RefreshSchedule
    precision: Precision
    seed: int  # slot seeds (seed + index), randomized-SVD generators, stochastic rounding
