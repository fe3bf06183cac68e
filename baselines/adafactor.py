"""Adafactor baseline (Shazeer & Stern, 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
Alg. 4 with Sec. 5's update clipping): ``transformers``' ``Adafactor`` used as published, not re-implemented.

The second moment of every matrix (a 2-D weight: embeddings, LM head, attention and MLP weights) is kept factored,
as its row and column means (``exp_avg_sq_row``, ``exp_avg_sq_col``: ``n + m`` fp32 values for an ``n × m``
weight, Sec. 3); a vector (norms, biases) keeps its full second moment. The decay is ``β₂ₜ = 1 − t^decay_rate``
(Sec. 7, −0.8), each update is clipped to RMS ``clip_threshold`` (Sec. 5, 1.0), and with ``beta1`` unset there is
no first moment at all: the state is the factored second moment (and a 0-d RMS per tensor).

The learning rate is the harness's (``method.lr`` under the loop's warm-up and cosine schedule): ``relative_step``
and ``warmup_init`` (Adafactor's own time-dependent step size) are off, as ``transformers`` documents for an
external schedule; ``scale_parameter=true`` multiplies each step by the weight's RMS (Sec. 8; it reads a value on
the host, so a dry run cannot trace it). Weights in BF16 are updated in an fp32 copy and written back, and the state
is fp32 whatever the weight's dtype (``transformers`` upcasts the gradient). Its steps are plain per-tensor
reductions of whole matrices, so FSDP2's row shards (whose row means would be a rank's own) are refused.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from baselines.driver import Built, OptimizerMethod, dist_error
from hmt_core.method import NotTraceableError, trainable_parameters


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "adafactor"
    fsdp2: ClassVar[bool] = False  # a row shard's row means are not the weight's
    lr: float = 1e-3
    beta1: float | None = None  # None: no first moment (the factored state alone); a value keeps a full one
    decay_rate: float = -0.8  # β₂ₜ = 1 − t^decay_rate
    clip_threshold: float = 1.0  # the update's RMS is clipped to this
    eps1: float = 1e-30  # added to the squared gradient
    eps2: float = 1e-3  # scale_parameter: the smallest weight RMS a step is scaled by
    weight_decay: float = 0.0
    scale_parameter: bool = False  # the step times the weight's RMS (Sec. 8)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"method.lr must be > 0, got {self.lr}")
        if self.beta1 is not None and not 0 <= self.beta1 < 1:
            raise ValueError(f"method.beta1 must be in [0, 1) or null (no first moment), got {self.beta1}")
        if not self.decay_rate < 0:
            raise ValueError(f"method.decay_rate must be < 0 (β₂ₜ = 1 − t^decay_rate), got {self.decay_rate}")
        if not self.clip_threshold > 0:
            raise ValueError(f"method.clip_threshold must be > 0, got {self.clip_threshold}")
        if not (self.eps1 > 0 and self.eps2 > 0):
            raise ValueError(f"method.eps1 and method.eps2 must be > 0, got {self.eps1}, {self.eps2}")
        if self.weight_decay < 0:
            raise ValueError(f"method.weight_decay must be >= 0, got {self.weight_decay}")

    def check(self, run: Any) -> None:
        """Nothing else in the run clashes with these settings (``hmt_core.method.MethodConfig``)."""

    def dist_error(self, dist: Any) -> str | None:
        return dist_error(self.name, dist)


@functools.cache
def _adafactor_class() -> type:
    from transformers.optimization import Adafactor

    class Fp32StateAdafactor(Adafactor):
        """transformers' ``Adafactor``, unchanged, but for ``load_state_dict``: torch casts loaded state to each
        parameter's dtype, which would round the fp32 moments of BF16 weights to BF16; they are put back as saved,
        so a resumed run holds exactly the state an uninterrupted one does."""

        def load_state_dict(self, state_dict) -> None:
            super().load_state_dict(state_dict)
            saved = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
            params = dict(zip(saved, itertools.chain.from_iterable(g["params"] for g in self.param_groups)))
            for index, entries in state_dict["state"].items():
                st = self.state[params[index]]
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        st[key] = value.to(device=params[index].device, copy=True)  # dtype as saved

    return Fp32StateAdafactor


def build(model: nn.Module, config: Config) -> Built:
    c = config
    params = trainable_parameters(model)
    if c.scale_parameter and any(is_fake(p) for p in params):
        raise NotTraceableError("method=adafactor with method.scale_parameter=true cannot be traced under "
                                "FakeTensorMode: each step compares the weight's RMS with eps2 on the host")
    opt = _adafactor_class()(params, lr=c.lr, eps=(c.eps1, c.eps2), clip_threshold=c.clip_threshold,
                             decay_rate=c.decay_rate, beta1=c.beta1, weight_decay=c.weight_decay,
                             scale_parameter=c.scale_parameter, relative_step=False, warmup_init=False)
    factored = sum(1 for p in params if p.dim() >= 2)
    return Built(opt, summary={"optim/factored_params": factored, "optim/first_moment": c.beta1 is not None})


def make(config: Config) -> OptimizerMethod:
    return OptimizerMethod("adafactor", build=functools.partial(build, config=config))
