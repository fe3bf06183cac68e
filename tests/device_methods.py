"""The method settings the device tiers run (tests/test_fake_cuda.py on fake CUDA tensors, tests/test_cuda_smoke.py
on a real GPU): label -> a factory of a fresh ``Method``, and the model dtype each needs."""

from __future__ import annotations

from collections.abc import Callable

from hmt_core.method import Method


def _adamw(**kw) -> Method:
    from baselines import adamw

    return adamw.make(adamw.Config(**kw))


def _galore(**kw) -> Method:
    from baselines import galore

    return galore.make(galore.Config(rank=8, **kw))


def _apollo(**kw) -> Method:
    from baselines import apollo

    return apollo.make(apollo.Config(**kw))


def _qlora(**kw) -> Method:
    from baselines import qlora

    return qlora.make(qlora.Config(**kw))


def _hmt(**kw) -> Method:
    from hmt_core import hmt

    return hmt.make(hmt.Config(**kw))


BASELINES: dict[str, Callable[[], Method]] = {
    "adamw": lambda: _adamw(),
    "adamw-master": lambda: _adamw(master_weights=True),
    "adamw-stochastic-rounding": lambda: _adamw(stochastic_rounding=True),
    "adamw-8bit": lambda: _adamw(eight_bit=True),
    "galore": lambda: _galore(),
    "apollo": lambda: _apollo(),
    "apollo-mini": lambda: _apollo(variant="mini"),
    "adamw-8bit-paged": lambda: _adamw(eight_bit=True, paged=True),
    "qlora": lambda: _qlora(),
}
# galore-torch's GaLoreAdamW8bit hands bitsandbytes a 0-d tensor where a float is declared (param_norm): a host
# read on CUDA, untraceable on fake tensors. It runs in the CUDA smoke tests only.
CUDA_ONLY_BASELINES: dict[str, Callable[[], Method]] = {"galore-8bit": lambda: _galore(eight_bit=True)}
HMT: dict[str, Callable[[], Method]] = {
    "hmt-mode-a-default": lambda: _hmt(),
    "hmt-mode-b-rank-1": lambda: _hmt(mode="B", basis="random", scaling="tensor", rank=1, scale=128.0,
                                      state_dtype="bf16"),
    "hmt-mode-b-dense-8bit": lambda: _hmt(mode="B", rank=1, dense_8bit=True),
    "hmt-int8-weights": lambda: _hmt(weight_dtype="int8", rank=8),
    "hmt-two-sided": lambda: _hmt(sides="two_sided", rank=8),
    "hmt-master-weights": lambda: _hmt(master_weights=True, rank=8),
    "hmt-stochastic-rounding": lambda: _hmt(stochastic_rounding=True, rank=8),
    "hmt-whole-step": lambda: _hmt(per_layer=False, rank=8),
    "hmt-offload-bases": lambda: _hmt(offload_bases=True, rank=8),
}
FP32_MODEL = {"adamw-master", "hmt-master-weights"}  # master weights are for low-precision weights: fp32 model


def model_dtype(label: str) -> str:
    return "fp32" if label in FP32_MODEL else "bf16"
