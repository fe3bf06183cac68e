"""The codecs' scales are IEEE divisions on every device: ATen's CUDA kernel turns a division by a Python number into
a multiplication by its reciprocal (``div_true_kernel_cuda``), which rounds differently from CPU and from the
Triton kernels' ``div_rn``; found on an H200, where the codecs' Triton kernels and their PyTorch references then
differed in every case (results/gpu/nvidia-h200-2026-11-26-lease2)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hmt_core import kernels
from hmt_core.activations import codecs
from hmt_core.int8_weights import codec as weight_codec

_DIVISIONS = {torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor, torch.ops.aten.div.Scalar,
              torch.ops.aten.div_.Scalar}


class _NumberDivisors(TorchDispatchMode):
    """Records every division whose divisor is a Python number (the CUDA reciprocal path)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _DIVISIONS and len(args) > 1 and isinstance(args[1], (int, float)):
            self.found.append(f"{func}(…, {args[1]!r})")
        return func(*args, **(kwargs or {}))


def _impl(op):  # a torch.library.custom_op's Python body: a dispatch mode sees the custom op, not its inner ops
    return op._init_fn


def test_div_rn_is_the_correctly_rounded_quotient_where_the_reciprocal_is_not():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 100
    for divisor in (127.0, 448.0, 57344.0, 15.0):
        exact = (x.double() / divisor).float()  # fp32 round of the fp64 quotient = IEEE fp32 division (exact
        # quotient rounded once: fp64 has more than 2·24 + 2 bits, so the double rounding is innocuous)
        got = kernels.div_rn(x, divisor)
        reciprocal = x * (1.0 / divisor)  # what CUDA computes for ``x / divisor``
        differ = int((reciprocal != exact).sum())
        assert torch.equal(got, exact), f"divisor {divisor}: {int((got != exact).sum())} quotients off"
        assert differ > 0, f"divisor {divisor}: the reciprocal path agrees everywhere, so this test shows nothing"


def test_codecs_never_divide_by_a_python_number():
    x = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    with kernels.using("torch"), _NumberDivisors() as mode:
        _impl(codecs.int8_block_quant)(x, 64)
        _impl(codecs.fp8_block_quant)(x, 64, "e4m3")
        _impl(codecs.fp8_block_quant)(x.bfloat16(), 128, "e5m2")
        for bits in (4, 8):
            _impl(codecs.outlier_quant)(x, bits, 64, 3.0, 2)
        weight_codec.quantize(x, 64)
        weight_codec.quantize(x, 64, stochastic=True, generator=torch.Generator().manual_seed(2))
    assert not mode.found, f"divisions by a Python number (CUDA multiplies by the reciprocal): {mode.found}"
