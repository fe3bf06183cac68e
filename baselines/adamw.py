"""BF16 AdamW baseline: ``torch.optim.AdamW`` (Loshchilov & Hutter, 2019) on every trainable parameter.

Kernels (``impl``): ``fused`` (default: one fused kernel per parameter group and dtype, no temporaries beyond its
own, the fastest path on CUDA), ``foreach`` (multi-tensor ops, torch's own default on CUDA: ``_foreach_sqrt``
copies every second moment at once) or ``single`` (one parameter at a time, torch's default on CPU). The choice is
always explicit, so a dry run traces the path a CUDA run executes (docs/dryrun-cuda.md).

Weight storage dtype comes from ``model.dtype`` (BF16 by default, as in GaLore's "BF16 baseline", whose
Adam moments then are BF16 too, since torch keeps moments in the parameter dtype).

Update precision (``hmt_core.precision``): at fine-tuning learning rates most BF16 round-to-nearest writes lose the
update. ``master_weights=true`` keeps an fp32 master copy of every low-precision weight and fp32 moments (standard
mixed-precision AdamW, Micikevicius et al., 2018) and refreshes the BF16 weight from the master after each step;
``stochastic_rounding=true`` keeps BF16 weights and BF16 moments (the baseline's memory) but writes each weight by
stochastic rounding of the fp32 result (Gupta et al., 2015), from a seeded generator saved in the state dict. Both
run ``PrecisionAdamW``: torch.optim.AdamW's formula and rounding order (``hmt_core.optim.update``, style
``"torch"``) computed in fp32, in row chunks of at most 16 MiB of fp32 temporaries.

Split learning rate (``dense_lr_scale``): the parameters HMT and GaLore do not project (embeddings, LM head,
norms, biases: everything but the 2-D ``attn``/``mlp`` weights of ``hmt_core.selection.projected_weight_names``) take
``lr × dense_lr_scale``, the projected ones ``lr``: two parameter groups, scheduled together. HMT updates its
projected weights at ``α·lr`` and its dense ones at ``lr``, so ``sides=identity`` at rate ``L`` is AdamW at
``lr = α·L`` with ``dense_lr_scale = 1/α`` (plus HMT's norm limiter): the control that separates HMT's split
rate from its projection (docs/campaign/findings.md). The default 1 is one group, torch's AdamW as before.

8-bit states (``eight_bit=true``): bitsandbytes' ``AdamW8bit`` (Dettmers et al., 2022, "8-bit Optimizers via
Block-wise Quantization", Sec. 2: each moment stored as uint8 codes of the signed / unsigned dynamic tree map,
normalized by the fp32 absmax of its block of 256 elements; dequantized to fp32, updated by AdamW, and
re-quantized inside one kernel). State per parameter of at least ``min_8bit_size`` elements (4096, bitsandbytes'
default): ``state1``/``state2`` uint8 (1 byte per element each), ``absmax1``/``absmax2`` fp32 (4 bytes per
256-element block each), ``qmap1``/``qmap2`` (256 fp32 each, shared by every parameter); smaller parameters
(norms, biases) keep fp32 ``state1``/``state2`` (8 bytes per element), bitsandbytes' rule. ``paged=true`` is
``PagedAdamW8bit`` (state of tensors of at least 10^5 elements in CUDA unified memory, evicted to host under
memory pressure): CUDA only; on a CPU device it is refused (bitsandbytes would silently fall back to
``AdamW8bit``), except in a dry run, which traces ``AdamW8bit``: the same state bytes, counted as resident on
the device (paging moves them to host under pressure, it does not shrink them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from baselines.driver import OPTIMIZER_IMPLS, Built, OptimizerMethod, dist_error, torch_optimizer_impl
from hmt_core.method import named_trainable_parameters, trainable_parameters
from hmt_core.optim import update as upd
from hmt_core.precision import UpdateWriter, write_rows
from hmt_core.selection import DEFAULT_PATTERNS, projected_weight_names


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "adamw"
    fsdp2: ClassVar[bool] = True  # torch AdamW steps FSDP2's DTensor shards
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    master_weights: bool = False  # fp32 master copies (+ fp32 moments) take the updates
    stochastic_rounding: bool = False  # BF16 weights written by stochastic rounding of the fp32 result
    seed: int = 0  # stochastic rounding's generator
    eight_bit: bool = False  # bitsandbytes AdamW8bit: block-wise 8-bit moments
    paged: bool = False  # with eight_bit: PagedAdamW8bit (CUDA unified memory for the state)
    impl: str = "fused"  # torch.optim.AdamW's kernels: fused | foreach | single (baselines.driver.torch_optimizer_impl)
    dense_lr_scale: float = 1.0  # rate of the parameters HMT does not project = lr × this (the matrices: lr)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"method.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"method.weight_decay must be >= 0, got {self.weight_decay}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"method.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.master_weights and self.stochastic_rounding:
            raise ValueError("method.master_weights and method.stochastic_rounding are alternatives: choose one")
        if self.eight_bit and (self.master_weights or self.stochastic_rounding):
            raise ValueError("method.eight_bit=true (bitsandbytes AdamW8bit writes the weights itself) cannot be "
                             "combined with method.master_weights or method.stochastic_rounding")
        if not self.dense_lr_scale > 0:
            raise ValueError(f"method.dense_lr_scale must be > 0, got {self.dense_lr_scale}")
        if self.eight_bit and self.dense_lr_scale != 1:
            raise ValueError("method.dense_lr_scale (a split rate) is not offered with method.eight_bit=true")
        if self.impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"method.impl must be one of {OPTIMIZER_IMPLS}, got {self.impl!r}")
        if self.impl != "fused" and (self.eight_bit or self.master_weights or self.stochastic_rounding):
            raise ValueError(f"method.impl={self.impl} chooses torch.optim.AdamW's kernels; with method.eight_bit, "
                             "method.master_weights or method.stochastic_rounding another optimizer runs: leave "
                             "method.impl at fused")
        if self.paged and not self.eight_bit:
            raise ValueError("method.paged=true pages bitsandbytes' 8-bit state: it needs method.eight_bit=true")

    def check(self, run: Any) -> None:
        """Nothing else in the run clashes with these settings (``hmt_core.method.MethodConfig``)."""

    def dist_error(self, dist: Any) -> str | None:
        return dist_error(self.name, dist, fsdp2_refusal=None if not (self.master_weights or self.stochastic_rounding) else (
            "dist=fsdp2 with method=adamw supports neither method.master_weights nor method.stochastic_rounding "
            "(the fp32 copy is not sharded); use dist=ddp"))


class PrecisionAdamW(torch.optim.Optimizer):
    """AdamW whose weight writes go through an ``UpdateWriter`` (fp32 master copy, or stochastic rounding).

    State per parameter (torch's names, so the meter and checkpoints see them): ``step`` (int), ``exp_avg`` and
    ``exp_avg_sq`` (fp32 with master weights, else the parameter's dtype; fp32 math, rounded on store) and
    ``master`` (fp32 copy of a low-precision weight, created with the optimizer).
    """

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 writer: UpdateWriter) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.writer = writer
        for group in self.param_groups:
            for p in group["params"]:
                master = writer.make_master(p)
                if master is not None:
                    self.state[p]["master"] = master

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("PrecisionAdamW does not take a closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                master = st.get("master")
                if "exp_avg" not in st:
                    dtype = torch.float32 if master is not None else p.dtype
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                    st["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                st["step"] += 1
                for index in write_rows(tuple(p.shape)):
                    m, v = upd.adam_moments_(st["exp_avg"][index], st["exp_avg_sq"][index], p.grad[index].float(),
                                             beta1, beta2, "torch")
                    d, step_size = upd.adam_step(m, v, st["step"], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                                 style="torch")
                    with self.writer.rows(p.data, master, index) as w:
                        upd.apply_update_(w, d, step_size=step_size, lr=lr, weight_decay=wd, style="torch")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["precision"] = self.writer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        precision = state_dict.pop("precision", None)
        super().load_state_dict(state_dict)
        # torch casts floating-point state to each parameter's dtype on load: fp32 masters and moments keep theirs
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if isinstance(value, Tensor) and value.is_floating_point():
                    self.state[p][key] = value.detach().clone().to(p.device)
        self.writer.load_state_dict(precision)


def _adamw8bit_class(paged: bool) -> type:
    import bitsandbytes as bnb  # optional dependency: only when asked for

    base = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit

    class SharedQmapAdamW8bit(base):
        """bitsandbytes' optimizer, unchanged, but for ``load_state_dict``: bitsandbytes deep-copies the state, so
        each parameter would get its own copy of the two 256-entry quantization maps; they are pointed back at the
        optimizer's shared maps (after checking they hold the same values), so a resumed run holds exactly the
        state a fresh one does."""

        def load_state_dict(self, state_dict, move_to_device=True):
            super().load_state_dict(state_dict, move_to_device=move_to_device)
            for st in self.state.values():
                for key, name in (("qmap1", "dynamic"), ("qmap2", "udynamic")):
                    if key in st and name in self.name2qmap:
                        shared = self.name2qmap[name].to(st[key].device)
                        if not is_fake(shared) and not torch.equal(shared, st[key]):
                            raise ValueError(f"checkpoint {key} differs from bitsandbytes' {name!r} map")
                        self.name2qmap[name] = st[key] = shared

    return SharedQmapAdamW8bit


def build_adamw8bit(params: list[nn.Parameter], c: Config) -> torch.optim.Optimizer:
    """bitsandbytes (Paged)AdamW8bit over ``params`` with ``c``'s hyperparameters (its defaults otherwise:
    ``min_8bit_size=4096``, block size 256). ``paged`` on real CPU tensors is a ``ValueError``."""
    cuda, fake = any(p.is_cuda for p in params), any(is_fake(p) for p in params)
    if c.paged and not (cuda or fake):
        raise ValueError("method.paged=true needs a CUDA device: paged optimizers keep their state in CUDA "
                         "unified memory (on CPU bitsandbytes falls back to AdamW8bit); use method.paged=false")
    # a dry run traces the paged optimizer as AdamW8bit: the same state tensors, which paging moves, not shrinks
    return _adamw8bit_class(c.paged and cuda)(params, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                                              weight_decay=c.weight_decay)


def param_groups(model: nn.Module, config: Config) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: one (every trainable parameter at ``lr``) for ``dense_lr_scale == 1``,
    else the projected weights at ``lr`` and the rest at ``lr × dense_lr_scale`` (HMT's split; a model with no
    projected weight is a ``ValueError``, as for HMT)."""
    named = named_trainable_parameters(model)
    if config.dense_lr_scale == 1:
        return [{"params": [p for _, p in named]}]
    projected = projected_weight_names(model, DEFAULT_PATTERNS)
    if not projected:
        raise ValueError(f"method.dense_lr_scale={config.dense_lr_scale} splits the rate between the projected "
                         f"weights (patterns {list(DEFAULT_PATTERNS)}) and the rest, but none matches")
    return [{"params": [p for n, p in named if n in projected]},
            {"params": [p for n, p in named if n not in projected], "lr": config.lr * config.dense_lr_scale}]


def build(model: nn.Module, config: Config) -> Built:
    c = config
    groups = param_groups(model, c)
    if c.eight_bit:
        return Built(build_adamw8bit(trainable_parameters(model), c), summary={"optim/eight_bit": True,
                                                                                "optim/paged": c.paged})
    if c.master_weights or c.stochastic_rounding:
        writer = UpdateWriter(master_weights=c.master_weights, stochastic_rounding=c.stochastic_rounding,
                              seed=c.seed)
        for name, p in named_trainable_parameters(model):
            writer.check(name, p)
        opt = PrecisionAdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay,
                             writer=writer)
        return Built(opt)
    opt = torch.optim.AdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                            weight_decay=c.weight_decay, **torch_optimizer_impl(c.impl))
    return Built(opt, summary={"optim/impl": c.impl})


def make(config: Config) -> OptimizerMethod:
    return OptimizerMethod("adamw", build=functools.partial(build, config=config))
