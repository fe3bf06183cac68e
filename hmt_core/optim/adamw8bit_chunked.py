"""bitsandbytes' ``AdamW8bit`` (Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization") stepped a
chunk of elements at a time.

bitsandbytes' block-wise state quantizes each block of 256 consecutive elements (of the flattened weight) on its own,
with one absmax per block, and its update kernel reads and writes block by block. A chunk that starts and ends on
block boundaries is therefore stepped exactly as in the whole-tensor call: the same kernel on views of the weight,
the gradient, both 8-bit moments and their absmax. On CUDA the kernel is fused and holds no temporaries, so chunks
cost a few launches and change nothing; bitsandbytes' CPU kernel (``backends/cpu/ops.py``) dequantizes both moments
to fp32 and makes fp32 copies of the gradient, the weight and the denominator — five fp32 copies of the weight, 18 GB
for Gemma 2's tied 256,000 × 3,584 embedding — which a chunk bounds to five chunk-sized ones.
"""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch
from torch import Tensor

from hmt_core.kernels.chunks import chunk_budget

QUANT_BLOCK = 256  # elements per absmax block of bitsandbytes' block-wise optimizer state (``init_state``)


def chunk_elements(like: Tensor) -> int:
    """Elements per chunk: one fp32 temporary within the row-chunk budget (``chunk_budget``), whole 256-element
    quantization blocks."""
    return max(QUANT_BLOCK, chunk_budget(like) // 4 // QUANT_BLOCK * QUANT_BLOCK)


class ChunkedAdamW8bit(bnb.optim.AdamW8bit):
    """``bnb.optim.AdamW8bit`` whose 8-bit step runs ``chunk_elements`` elements at a time (bit-identical to the
    whole-tensor step: ``tests/test_adamw8bit_chunked.py``). State, ``state_dict`` and small (fp32-state) weights are
    bitsandbytes' own."""

    def __init__(self, params, *, chunk: int | None = None, **kwargs) -> None:
        if chunk is not None and (chunk <= 0 or chunk % QUANT_BLOCK):
            raise ValueError(f"chunk={chunk}: a positive multiple of {QUANT_BLOCK} elements")
        super().__init__(params, **kwargs)
        self.chunk = chunk

    @torch.no_grad()
    def update_step(self, group: dict, p: Tensor, gindex: int, pindex: int) -> None:
        state = self.state[p]
        chunk = self.chunk or chunk_elements(p)
        if state["state1"].dtype != torch.uint8 or p.numel() <= chunk:
            super().update_step(group, p, gindex, pindex)
            return
        config = self.get_config(gindex, pindex, group)
        state["step"] += 1
        flat = [t.view(-1) for t in (p.grad.contiguous(), p.data, state["state1"], state["state2"])]
        beta3 = config["betas"][2] if len(config["betas"]) >= 3 else 0.0
        for a in range(0, p.numel(), chunk):
            grad, weight, m, v = (t[a:a + chunk] for t in flat)  # (chunk,) views: the kernel writes in place
            blocks = slice(a // QUANT_BLOCK, -(-(a + grad.numel()) // QUANT_BLOCK))
            bnbf.optimizer_update_8bit_blockwise(
                self.optimizer_name, grad, weight, m, v, config["betas"][0], config["betas"][1], beta3,
                config.get("alpha", 0.0), config["eps"], state["step"], config["lr"], state["qmap1"],
                state["qmap2"], state["absmax1"][blocks], state["absmax2"][blocks], config["weight_decay"],
                gnorm_scale=1.0, skip_zeros=config["skip_zeros"])
