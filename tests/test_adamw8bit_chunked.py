"""``ChunkedAdamW8bit`` steps bitsandbytes' 8-bit AdamW a chunk at a time: bit-identical to bitsandbytes' own
whole-tensor step, and on CPU its temporaries are a chunk's, not the weight's."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from hmt_core.optim.adamw8bit_chunked import QUANT_BLOCK, ChunkedAdamW8bit, chunk_elements


def _trajectory(make, shape, steps=4, dtype=torch.bfloat16):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(shape).to(dtype))
    opt = make([weight])
    for step in range(steps):
        weight.grad = torch.randn(shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        opt.step()
    return weight.detach().clone(), opt.state[weight]


# 300 x 1,000 = 300,000 elements: 1,172 blocks, the last one partial (160 elements); chunks of 7 and 64 blocks end
# inside rows, and the last chunk is shorter than the rest
@pytest.mark.parametrize("chunk", [7 * QUANT_BLOCK, 64 * QUANT_BLOCK])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_chunked_step_is_bitsandbytes_whole_step_bit_for_bit(chunk, weight_decay):
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    ref_w, ref = _trajectory(lambda p: bnb.optim.AdamW8bit(p, **kw), (300, 1000))
    got_w, got = _trajectory(lambda p: ChunkedAdamW8bit(p, chunk=chunk, **kw), (300, 1000))
    assert ref["state1"].dtype == torch.uint8  # the 8-bit path, not bitsandbytes' fp32 state for small weights
    assert got["step"] == ref["step"] == 4
    for key in ("state1", "state2", "absmax1", "absmax2"):
        diff = (got[key].float() - ref[key].float()).abs().max().item()
        assert torch.equal(got[key], ref[key]), f"{key}: max |diff| {diff}"
    assert torch.equal(got_w, ref_w), f"weights: max |diff| {(got_w.float() - ref_w.float()).abs().max().item()}"


def test_small_weight_keeps_bitsandbytes_fp32_state():
    ref_w, ref = _trajectory(lambda p: bnb.optim.AdamW8bit(p, lr=1e-3), (64,))
    got_w, got = _trajectory(lambda p: ChunkedAdamW8bit(p, chunk=QUANT_BLOCK, lr=1e-3), (64,))
    assert got["state1"].dtype == torch.float32 and torch.equal(got_w, ref_w)


def test_chunk_is_whole_blocks_within_the_row_chunk_budget():
    n = chunk_elements(torch.empty(1))
    assert n % QUANT_BLOCK == 0 and n * 4 <= 16 << 20, n
    with pytest.raises(ValueError, match="multiple of 256"):
        ChunkedAdamW8bit([torch.nn.Parameter(torch.zeros(4))], chunk=100)
