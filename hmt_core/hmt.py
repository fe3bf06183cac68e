"""The ``hmt`` method: dynamic low-rank gradient projection with Mode A (GaLore-style low-rank AdamW) or
Mode B (APOLLO-style gradient scaling), updated per layer inside backward.

HMT design (shared/seeds/000_hmt_design.txt), "Dynamic Low-Rank Gradient Projection": ``Ĝ_l = P_lᵀ G_l Q_l``
(two-sided) or GaLore's one-sided rule (Zhao et al., 2024, Alg. 2), bases from exact SVD, randomized SVD or
a seeded Gaussian (APOLLO, Zhu et al., 2024), refreshed every ``update_interval`` steps; rank by spectral
energy ``E(r) ≥ τ`` (``hmt_core.rank``; random bases by the energy they capture), capped so the
projected state fits ``state_budget`` (``hmt_core.rank_budget``; default: GaLore's at its default rank). Update math:
``hmt_core.optim.update`` (with per-coordinate bias-correction clocks after a rank increase); per-layer hooks,
gradient accumulation and the clipping rule: ``hmt_core.optim.hooks``. Update precision (``master_weights``:
fp32 master copies, counted as optimizer state; ``stochastic_rounding``: BF16 writes rounded stochastically from a
generator saved in the state dict): ``hmt_core.precision``. ``weight_dtype="int8"`` (Q-GaLore, Zhang et al., 2024,
§3.3): ``prepare`` stores every projected weight as INT8 codes with per-block scales, dequantized one layer at a
time in forward and backward, and every update is requantized by stochastic rounding (``hmt_core.int8_weights``);
the LM head and the non-projected weights keep the model's dtype. ``embedding_dtype="int8"`` stores the input
embedding and the LM head the same way (``hmt_core.int8_weights.embedding``; the fused cross-entropy dequantizes the
head one vocabulary block at a time); with ``dense_8bit`` the dense INT8 embedding's moments are 8-bit block-wise
(``hmt_core.optim.moments8``) instead of bitsandbytes' (which cannot write INT8 codes); ``embedding_update`` updates
either table by its touched rows inside backward (``hmt_core.sparse_embedding``; 8-bit row moments with ``dense_8bit``).

Row-sharded parameters (FSDP2 DTensors): ``attach`` builds slots on the local shards and runs per-layer Mode A through
``hmt_core.optim.sharded.ShardedEngine`` (its docstring gives the math and the collectives).

Which parameters are projected (``projected_weight_names``, shared with the galore and apollo baselines): 2-D
weights of ``nn.Linear`` and ``transformers``' ``Conv1D`` (GPT-2's layers, weight stored (in, out)) modules
whose qualified name matches one of ``target_patterns`` (regular expressions, ``re.search``; default
``attn``/``mlp`` as in galore-torch's scripts); patterns matching none are an error, never a silent dense
run. Everything else (embeddings, norms, lm_head, biases) gets AdamW (same ``adam_style``; fp32 arithmetic, moments
stored in ``dense_state_dtype``: by default the weight's dtype, as torch.optim.AdamW and galore-torch keep them, so
the default's whole optimizer state stays at or below GaLore's), or bitsandbytes' ``AdamW8bit`` with
``dense_8bit=True``.

Layout: projection and update act on the gradient's own (rows, cols), whatever a layer calls them. The
one-sided rule keeps the longer side at full size, and Mode B's ``channel`` scaling runs over that side, so for
a non-square weight the channels are the same features whether it is stored (out, in) or (in, out) — e.g.
the MLP's wide side. For a square weight (GPT-2's attention ``c_proj``) rows ≥ cols picks the right-sided
basis: channels are rows, i.e. output features of an ``nn.Linear`` but input features of a ``Conv1D``, and
the projected subspace is the input space of the one and the output space of the other. Both are valid
low-rank projections; two-sided projection and ``tensor`` scaling do not depend on layout at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hmt_core import int8_weights
from hmt_core.kernels import BACKENDS as KERNEL_BACKENDS
from hmt_core.basis_cache import BasisCache, basis_bytes
from hmt_core.state_bytes import state_bytes_summary
from hmt_core.optim import sharded as sh
from hmt_core.optim.head_update import config_error as head_update_config_error
from hmt_core.optim.head_update import install_head_update
from hmt_core.optim.hooks import PerLayerEngine
from hmt_core.optim.optimizer import LowRankOptimizer, Slot
from hmt_core.optim.row_adam import VARIANTS as EMBEDDING_UPDATES
from hmt_core.optim.row_adam import RowAdamConfig
from hmt_core.sparse_embedding import SparseEmbeddingUpdate
from hmt_core.sparse_embedding import install as install_sparse_embedding
from hmt_core.optim.update import MOMENT_POLICIES, STYLES
from hmt_core.parallel import ParallelContext
from hmt_core.projection import SIDES, SOURCES
from hmt_core.rank import FALLBACKS
from hmt_core.rank_budget import normalize_state_budget


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "hmt"
    mode: str = "A"  # "A": low-rank AdamW; "B": APOLLO scaling
    lr: float = 1e-2  # GaLore/APOLLO's default LR for projected training
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
    target_patterns: tuple[str, ...] = ("attn", "mlp")
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

    def __post_init__(self) -> None:
        for key in ("rank_candidates", "attn_candidates", "mlp_candidates", "target_patterns"):  # YAML lists
            value = getattr(self, key)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, key, tuple(value))

        def choice(key: str, options: tuple[str, ...]) -> None:
            if getattr(self, key) not in options:
                raise ValueError(f"method.{key} must be one of {options}, got {getattr(self, key)!r}")

        choice("mode", ("A", "B"))
        choice("adam_style", STYLES)
        choice("sides", SIDES)
        choice("basis", SOURCES)
        choice("rank_fallback", FALLBACKS)
        choice("moment_policy", MOMENT_POLICIES)
        choice("state_dtype", ("fp32", "bf16"))
        choice("dense_state_dtype", ("weight", "fp32", "bf16"))
        choice("kernels", KERNEL_BACKENDS)
        choice("scaling", ("channel", "tensor"))
        choice("random_rank", ("captured", "spectrum"))
        choice("weight_dtype", ("bf16", "int8"))
        choice("embedding_dtype", ("bf16", "int8"))
        choice("embedding_update", EMBEDDING_UPDATES)
        choice("head_update", ("dense", "in_loss"))
        if self.head_update == "in_loss" and head_update_config_error(self):
            raise ValueError(f"method.head_update=in_loss: {head_update_config_error(self)}")
        if self.embedding_update != "dense":
            clash = ("method.per_layer=false" if not self.per_layer
                     else "method.master_weights=true" if self.master_weights
                     else "method.stochastic_rounding=true" if self.stochastic_rounding else None)
            if clash:
                raise ValueError(f"method.embedding_update={self.embedding_update} updates the embedding's rows inside "
                                 f"backward with its own moments; it cannot be combined with {clash}")
        object.__setattr__(self, "state_budget", normalize_state_budget(self.state_budget))
        if not self.lr > 0:
            raise ValueError(f"method.lr must be > 0, got {self.lr}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"method.{key} must be in [0, 1), got {getattr(self, key)}")
        if not self.eps > 0:
            raise ValueError(f"method.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"method.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.scale > 0:
            raise ValueError(f"method.scale must be > 0, got {self.scale}")
        if self.rank is not None and self.rank <= 0:
            raise ValueError(f"method.rank must be a positive integer or None (dynamic), got {self.rank}")
        for key in ("rank_candidates", "attn_candidates", "mlp_candidates"):
            value = getattr(self, key)
            if value is not None and (len(value) == 0 or any(int(r) <= 0 for r in value)):
                raise ValueError(f"method.{key} must be a non-empty tuple of positive ranks, got {value}")
        if not 0 < self.tau <= 1:
            raise ValueError(f"method.tau must be in (0, 1], got {self.tau}")
        if self.update_interval <= 0:
            raise ValueError(f"method.update_interval must be > 0, got {self.update_interval}")
        if self.power_iters < 0 or self.oversample < 0:
            raise ValueError(f"method.power_iters and method.oversample must be >= 0, got "
                             f"{self.power_iters}, {self.oversample}")
        if self.limiter_gamma < 1:
            raise ValueError(f"method.limiter_gamma must be >= 1, got {self.limiter_gamma}")
        if self.mode == "B" and self.sides == "two_sided" and self.scaling == "channel":
            raise ValueError("method.scaling='channel' needs one-sided projection in mode B; use 'tensor'")
        if self.master_weights and self.stochastic_rounding:
            raise ValueError("method.master_weights and method.stochastic_rounding are alternatives: choose one")
        if self.dense_8bit and (self.master_weights or self.stochastic_rounding):
            raise ValueError("method.dense_8bit=true (bitsandbytes AdamW8bit writes the weights itself) cannot be "
                             "combined with method.master_weights or method.stochastic_rounding")
        for key in ("weight_dtype", "embedding_dtype"):
            if getattr(self, key) == "int8" and self.master_weights:
                raise ValueError(f"method.{key}=int8 writes its updates by stochastic rounding; "
                                 "method.master_weights=true (an fp32 copy of every weight) would defeat it")
        if self.offload_bases and not self.per_layer:
            raise ValueError("method.offload_bases=true needs method.per_layer=true")
        if self.basis_cache_mib <= 0:
            raise ValueError(f"method.basis_cache_mib must be > 0, got {self.basis_cache_mib}")
        if not self.target_patterns:
            raise ValueError("method.target_patterns must name at least one pattern")
        for pattern in (*self.target_patterns, self.attn_pattern, self.mlp_pattern):
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"method.target_patterns: invalid regular expression {pattern!r}: {err}") from None


def projectable_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every ``nn.Linear`` and ``transformers`` ``Conv1D`` module with a 2-D weight."""
    kinds: tuple[type, ...] = (nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D

        kinds = (nn.Linear, Conv1D)
    except ImportError:  # transformers is optional for hmt_core itself
        pass
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, kinds) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            yield name, module


def projected_weight_names(model: nn.Module, patterns: tuple[str, ...]) -> set[str]:
    """Qualified names of the trainable 2-D ``nn.Linear``/``Conv1D`` weights whose module name matches a
    pattern (``re.search``); empty when none does (``require_projected_weights`` makes that an error)."""
    names = set()
    for mod_name, module in projectable_modules(model):
        if module.weight.requires_grad and any(re.search(p, mod_name) for p in patterns):
            names.add(f"{mod_name}.weight" if mod_name else "weight")
    return names


def require_projected_weights(model: nn.Module, patterns: tuple[str, ...],
                              key: str = "method.target_patterns") -> set[str]:
    """``projected_weight_names``, or a ``ValueError`` naming ``key``, the model type and a few module names
    when the patterns match no weight (a projected method would otherwise silently train dense AdamW)."""
    names = projected_weight_names(model, patterns)
    if names:
        return names
    model_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    candidates = [n for n, _ in projectable_modules(model)] or [n for n, _ in model.named_parameters()]
    examples = list(dict.fromkeys(re.sub(r"\.\d+\.", ".N.", n) for n in candidates))[:6]
    raise ValueError(f"{key}={list(patterns)} match no 2-D Linear/Conv1D weight of {model_type}; names look like: "
                    + (", ".join(examples) if examples else "(the model has no parameters)"))


def projected_elements(params) -> int:
    """Elements in the projected weights ``params`` (the ``projected_params`` summary entry)."""
    return int(sum(p.numel() for p in params))


class HMTMethod:
    name = "hmt"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.opt: LowRankOptimizer | None = None
        self.engine: PerLayerEngine | None = None
        self.max_grad_norm: float | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.device: torch.device | None = None  # the training device (the model's at attach)
        self.rows: SparseEmbeddingUpdate | None = None  # method.embedding_update != dense

    def prepare(self, model: nn.Module) -> nn.Module:
        """``weight_dtype="int8"``: the projected weights (but the LM head) become ``Int8Linear`` layers;
        ``embedding_dtype="int8"``: the input embedding and the LM head become ``Int8Embedding`` / ``Int8Linear``."""
        if self.config.embedding_dtype == "int8":
            int8_weights.quantize_vocab(model, backend=self.config.kernels)
        if self.config.weight_dtype == "int8":
            int8_weights.quantize_linears(model, self._int8_targets(model), backend=self.config.kernels)
        return model

    def _int8_targets(self, model: nn.Module) -> set[str]:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return {n for n in require_projected_weights(model, self.config.target_patterns)
                if head is None or model.get_submodule(n.removesuffix(".weight")) is not head}

    def attach(self, model: nn.Module, *, max_grad_norm: float | None) -> None:
        c = self.config
        targets = require_projected_weights(model, c.target_patterns)
        if c.weight_dtype == "int8":
            plain = sorted(n for n in self._int8_targets(model) if not int8_weights.is_phantom(model.get_parameter(n)))
            if plain:
                raise ValueError(f"method.weight_dtype=int8: {plain[0]} (and {len(plain) - 1} more) is not INT8; "
                                 "call prepare(model) before attach")
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        sharded = any(sh.is_sharded(p) for _, p in trainable)  # FSDP2: every parameter a row-sharded DTensor
        if sharded and (sh.sharded_config_error(c) or not all(sh.is_sharded(p) for _, p in trainable)):
            raise ValueError(sh.sharded_config_error(c) or "sharded HMT needs every trainable parameter sharded")
        slots = []
        for index, (name, p) in enumerate(trainable, 1):
            if int8_weights.is_phantom(p):  # the optimizer updates an INT8 weight through its handle
                p = model.get_submodule(name.removesuffix(".weight")).handle
            projected = name in targets
            if projected and c.rank is not None and c.sides != "identity" and c.rank > min(p.shape):
                raise ValueError(f"method.rank={c.rank} exceeds min(out, in)={min(p.shape)} of {name} "
                                 f"{tuple(p.shape)}")
            candidates = c.rank_candidates
            if c.attn_candidates is not None and re.search(c.attn_pattern, name):
                candidates = c.attn_candidates
            elif c.mlp_candidates is not None and re.search(c.mlp_pattern, name):
                candidates = c.mlp_candidates
            make = sh.sharded_slot if sharded else Slot
            slots.append(make(name=name, param=p, index=index, projected=projected,
                              candidates=tuple(int(r) for r in candidates)))
        self.opt = LowRankOptimizer(slots, c)
        self.device = trainable[0][1].device if trainable else None
        self.max_grad_norm = max_grad_norm
        if self.engine is not None:
            self.engine.remove()
        cache = None
        if c.offload_bases and slots:
            cache = BasisCache(slots[0].param.device, c.basis_cache_mib * 2**20)
        if sharded:
            self.engine = sh.ShardedEngine(self.opt, max_grad_norm=max_grad_norm)
        else:
            self.engine = PerLayerEngine(self.opt, max_grad_norm=max_grad_norm, cache=cache) if c.per_layer else None
        install_head_update(model, self.engine, c, sharded=sharded)
        self.rows = None
        if c.embedding_update != "dense":
            self.rows = install_sparse_embedding(model, self.opt, self.engine, RowAdamConfig(
                variant=c.embedding_update, beta1=c.beta1, beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay,
                style=c.adam_style))

    def set_parallel(self, context: ParallelContext) -> bool:  # hmt_core.method; the engine's part: sh.take_parallel
        return sh.take_parallel(self.engine, self.opt, context)

    def start_micro_batch(self, index: int, count: int) -> None:
        if self.engine is not None:
            self.engine.start_micro_batch(index, count)

    def step(self) -> torch.Tensor | None:  # () fp32 on the device, NaN for a step skipped on the device
        self.last_grad_norm = (self.engine.finish_step() if self.engine is not None
                               else self.opt.step_all(self.max_grad_norm))
        return self.last_grad_norm

    def zero_grad(self) -> None:
        for s in self.opt.slots:
            (s.param if s.grad_param is None else s.grad_param).grad = None
            s.pending = None
        if self.engine is not None:
            self.engine.discard_step()
        if self.rows is not None:
            self.rows.discard()

    def materialize_weights(self) -> None:
        """The weights dense AdamW would hold now (``embedding_update=lazy_exact`` catches rows up when read; an
        exported model must have every row current). A no-op for every other setting."""
        if self.rows is not None:
            self.rows.materialize()

    def set_lr_scale(self, scale: float) -> None:
        self.opt.set_lr(self.config.lr * scale)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.opt.state_tensors()  # the embedding's row moments are its slot's m, v
        if self.rows is not None:
            moments = (self.rows.state.m, self.rows.state.v)
            yield from (t for t in self.rows.state.tensors() if not any(t is x for x in moments))

    def metrics(self) -> dict[str, float]:
        self.opt.reconcile()  # the host reads values here anyway (a logging step)
        out = dict(self.opt.history.metrics())
        out["optim/basis_refreshes"] = float(self.opt.refreshes)
        out["optim/basis_fallbacks"] = float(self.opt.fallbacks)
        if self.last_grad_norm is not None:
            out["optim/grad_norm"] = float(self.last_grad_norm)
        out.update(self.cache_stats())
        out.update(self.opt.budget_metrics())
        return out

    def cache_stats(self) -> dict[str, float]:
        cache = self.engine.cache if self.engine is not None else None
        return {} if cache is None else cache.stats(sum(basis_bytes(s.basis) for s in self.opt.slots))

    def summary(self) -> dict[str, Any]:
        out = self.opt.history.summary()
        out.update(state_bytes_summary(self.state_tensors(), self.device))  # host: parked bases (offload_bases)
        out.update({k: int(v) for k, v in self.opt.budget_metrics().items()})
        out["optim/projected_params"] = sum(1 for s in self.opt.slots if s.projected)  # tensors
        out["projected_params"] = projected_elements(s.param for s in self.opt.slots if s.projected)  # elements
        out["optim/basis_fallbacks"] = self.opt.fallbacks
        if self.config.master_weights:
            out["optim/master_bytes"] = sum(s.master.numel() * 4 for s in self.opt.slots if s.master is not None)
        quantized = [s.param for s in self.opt.slots if isinstance(s.param, int8_weights.Int8Weight)]
        if quantized:
            out["int8/weights"] = len(quantized)
            out["int8/weight_bytes"] = sum(q.nbytes() for q in quantized)  # codes + scales
        out.update(self.cache_stats())
        return out

    def state_dict(self) -> dict[str, Any]:
        state = self.opt.state_dict()
        state["lagged_clip_coef"] = self.engine.lagged_coef if self.engine is not None else None
        if self.rows is not None:
            state["embedding_rows"] = {k: v for k, v in self.rows.state.state_dict().items() if k not in ("m", "v")}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state)
        if self.engine is not None:
            self.engine.lagged_coef = state.get("lagged_clip_coef")
        if self.rows is not None:  # the moments came back as the slot's m, v
            self.rows.state.load_state_dict(state.get("embedding_rows", {}))
            self.rows.state.m, self.rows.state.v = self.rows.slot.m, self.rows.slot.v


def make(config: Config) -> HMTMethod:
    return HMTMethod(config)
