"""BF16 AdamW baseline: ``torch.optim.AdamW`` (Loshchilov & Hutter, 2019) on every trainable parameter.

Weight storage dtype comes from ``model.dtype`` (BF16 by default, as in GaLore's "BF16 baseline", whose
Adam moments then are BF16 too, since torch keeps moments in the parameter dtype).

Update precision (``hmt_core.precision``): at fine-tuning learning rates most BF16 round-to-nearest writes lose the
update. ``master_weights=true`` keeps an fp32 master copy of every low-precision weight and fp32 moments (standard
mixed-precision AdamW, Micikevicius et al., 2018) and refreshes the BF16 weight from the master after each step;
``stochastic_rounding=true`` keeps BF16 weights and BF16 moments (the baseline's memory) but writes each weight by
stochastic rounding of the fp32 result (Gupta et al., 2015), from a seeded generator saved in the state dict. Both
run ``PrecisionAdamW``: torch.optim.AdamW's formula and rounding order (``hmt_core.optim.update``, style
``"torch"``) computed in fp32, in row chunks of at most 16 MiB of fp32 temporaries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hmt_core.driver import Built, OptimizerMethod
from hmt_core.method import named_trainable_parameters, trainable_parameters
from hmt_core.optim import update as upd
from hmt_core.precision import UpdateWriter, write_rows


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    master_weights: bool = False  # fp32 master copies (+ fp32 moments) take the updates
    stochastic_rounding: bool = False  # BF16 weights written by stochastic rounding of the fp32 result
    seed: int = 0  # stochastic rounding's generator

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


def build(model: nn.Module, config: Config) -> Built:
    c = config
    if c.master_weights or c.stochastic_rounding:
        writer = UpdateWriter(master_weights=c.master_weights, stochastic_rounding=c.stochastic_rounding,
                              seed=c.seed)
        for name, p in named_trainable_parameters(model):
            writer.check(name, p)
        opt = PrecisionAdamW(trainable_parameters(model), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                             weight_decay=c.weight_decay, writer=writer)
        return Built(opt)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                            weight_decay=c.weight_decay)
    return Built(opt)


def make(config: Config) -> OptimizerMethod:
    return OptimizerMethod("adamw", build=functools.partial(build, config=config))
