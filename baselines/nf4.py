"""NF4 base weights as bitsandbytes stores and computes them, for QLoRA (Dettmers et al., 2023, Sec. 3): 4-bit
NormalFloat codes packed two per byte, one absmax per block of 64 weights, and with Double Quantization those
absmax values quantized again to 8 bits (their mean as an fp32 offset, one fp32 absmax per 256 of them and the
256-entry dynamic map), so a weight of ``n`` elements keeps ``n/2`` bytes of codes plus ``n/64`` bytes (or
``4n/64`` without double quantization) of block constants.

Two things here make the memory meter (``experiments.memory.meter``) see what a QLoRA step really holds:

- ``Linear4bit``: bitsandbytes' ``Linear4bit``, whose forward runs with ``Visible4bitGemm`` on CPU (and fake)
  tensors. bitsandbytes' forward calls its ``gemm_4bit`` op, which on CPU is its default implementation
  (``_gemm_4bit_default_impl``: the absmax dequantized to fp32, the whole weight dequantized to the compute
  dtype, ``F.linear``), as on CUDA for more than 1,536 rows (``backends/cuda/ops.py``'s
  ``_dequant_linear_fallback``, which also keeps the fp32 absmax from before the offset: 4 bytes per 64 weights
  more); as one op it hides that weight-sized temporary from a dispatch-mode meter. The mode runs the same
  function through the dispatcher instead, so the meter (and a dry run) sees it; the arithmetic is the one the op
  runs on CPU. The backward (``MatMul4Bit.backward``) dequantizes the weight with ordinary calls, which the meter
  sees anyway.
- ``quantize_nf4`` / ``fake_params4bit``: under ``FakeTensorMode`` (``mode=dryrun``) bitsandbytes' ``Params4bit``
  cannot wrap a fake tensor, so the dry run builds the same storage — ``bitsandbytes.functional.quantize_4bit``'s
  sequence of ops, which bitsandbytes implements for fake tensors, into a ``QuantState`` — held by a frozen
  ``nn.Parameter`` carrying ``Params4bit``'s attributes. Everything after that (peft's adapters, bitsandbytes'
  ``Linear4bit.forward``, ``matmul_4bit``, ``MatMul4Bit``) is the library code a real run executes.
"""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch
from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

BLOCKSIZE = 64  # Params4bit's default block size (QLoRA's)
NESTED_BLOCKSIZE = 256  # quantize_4bit's block size for the double-quantized absmax
DYNAMIC_MAP_SIZE = 256  # entries of bitsandbytes' 8-bit dynamic map (create_dynamic_map)


class Visible4bitGemm(TorchDispatchMode):
    """Runs ``bitsandbytes::gemm_4bit`` on CPU or fake tensors as bitsandbytes' own default kernel
    (``_gemm_4bit_default_impl``, the kernel the op dispatches to on CPU), op by op through the modes beneath
    this one, so a meter sees the dequantized weight. Every other op, and CUDA tensors, pass through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.bitsandbytes.gemm_4bit.default and not args[0].is_cuda:
            return _gemm_4bit_default_impl(*args, **kwargs)
        return func(*args, **kwargs)


class Linear4bit(bnb.nn.Linear4bit):
    """bitsandbytes' ``Linear4bit``; its 4-bit matmul's temporaries are visible to a meter (``Visible4bitGemm``)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda:
            return super().forward(x)
        with Visible4bitGemm():
            return super().forward(x)


def quantize_nf4(weight: Tensor, *, double_quant: bool) -> tuple[Tensor, F.QuantState]:
    """What ``bitsandbytes.functional.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant,
    quant_type="nf4")`` returns — packed codes ``((n + 1) // 2, 1)`` uint8 and a ``QuantState`` (NF4 map (16,) fp32;
    absmax (ceil(n/64),) fp32, or uint8 with ``offset`` () fp32 and ``state2`` holding absmax (ceil(n/64/256),)
    fp32 and a copy of the dynamic map (256,) fp32) — by the same ops, for fake tensors. The one difference:
    bitsandbytes caches its dynamic map in a module-level dict, which must never hold a fake tensor, so the map
    here is a fresh (256,) fp32 tensor (a fake tensor has no values to get wrong)."""
    weight = weight.contiguous()  # (out, in), the compute dtype
    packed, absmax = torch.ops.bitsandbytes.quantize_4bit.default(weight, BLOCKSIZE, "nf4", torch.uint8)
    code = F.get_4bit_type("nf4", device=weight.device)
    common = dict(shape=weight.shape, dtype=weight.dtype, blocksize=BLOCKSIZE, code=code, quant_type="nf4")
    if not double_quant:
        return packed, F.QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    dynamic = torch.empty(DYNAMIC_MAP_SIZE, dtype=torch.float32, device=weight.device)
    qabsmax, absmax2 = torch.ops.bitsandbytes.quantize_blockwise.default(absmax - offset, dynamic, NESTED_BLOCKSIZE)
    state2 = F.QuantState(absmax=absmax2, code=dynamic.clone(), blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
    return packed, F.QuantState(absmax=qabsmax, offset=offset, state2=state2, **common)


def fake_params4bit(weight: Tensor, *, double_quant: bool) -> nn.Parameter:
    """A frozen parameter holding ``quantize_nf4(weight)``'s packed codes with the attributes bitsandbytes' and
    peft's code read from a ``Params4bit`` (``quant_state``, ``blocksize``, ``quant_type``, ...): the dry run's
    stand-in for ``Params4bit(weight).to(device)``. Only for fake ``weight`` (a real one gets the real thing)."""
    if not is_fake(weight):
        raise ValueError("fake_params4bit is the dry run's stand-in; quantize real weights with bnb.nn.Params4bit")
    packed, state = quantize_nf4(weight, double_quant=double_quant)
    param = nn.Parameter(packed, requires_grad=False)
    param.quant_state, param.blocksize, param.quant_type = state, BLOCKSIZE, "nf4"
    param.compress_statistics, param.quant_storage = double_quant, torch.uint8
    param.bnb_quantized, param.module = True, None
    return param
