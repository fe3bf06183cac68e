"""Codecs for saved activations: accuracy, layout/bytes, adversarial inputs, custom-op fake impls."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hmt_core.activations.codecs import (
    decode,
    encode,
    int8_block_dequant,
    int8_block_quant,
    outlier_quant,
    outlier_slots,
    packed_nbytes,
)

CODECS = [("int8", {}), ("fp8", {"fp8_format": "e4m3"}), ("fp8", {"fp8_format": "e5m2"}), ("int4_outlier", {}),
          ("int8_outlier", {})]
# rel. L2 error bounds on N(0, 1) data, block 128 (measured ~0.0066 / 0.026 / 0.051 / 0.117 / 0.0064)
BOUNDS = [0.01, 0.035, 0.07, 0.15, 0.01]


def _gen(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _rel(x, y):
    return float((x.double() - y.double()).norm() / x.double().norm())


@pytest.mark.parametrize(("codec", "kw", "bound"), [(*c, b) for c, b in zip(CODECS, BOUNDS)])
def test_round_trip_gaussian_error(codec, kw, bound):
    x = _gen(64, 256)
    y = decode(encode(x, codec, block=128, **kw))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert _rel(x, y) < bound


def test_int8_matches_per_block_reference_on_odd_shape():
    """Blockwise semantics incl. the zero-padded tail: (3, 5, 7) = 105 elements in blocks of 16."""
    x = _gen(3, 5, 7, seed=1) * 3
    q, scale = int8_block_quant(x, 16)
    assert q.shape == (7, 16) and scale.shape == (7,)
    flat = x.reshape(-1)
    expected = torch.empty_like(flat)
    for b in range(7):
        chunk = flat[16 * b: 16 * (b + 1)]
        s = chunk.abs().max() / 127
        expected[16 * b: 16 * (b + 1)] = torch.round(chunk / s) * s
    y = int8_block_dequant(q, scale, [3, 5, 7], torch.float32)
    torch.testing.assert_close(y.reshape(-1), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("codec", "kw"), CODECS)
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (2, 3, 33), (17, 1)])
def test_odd_shapes_round_trip(codec, kw, shape):
    x = _gen(*shape, seed=2)
    y = decode(encode(x, codec, block=16, **kw))
    assert y.shape == x.shape
    assert _rel(x, y) < 0.2  # int4 on 1-element blocks is exact-ish; the point is shape/padding handling


@pytest.mark.parametrize(("codec", "kw"), CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_zeros_exact(codec, kw, dtype):
    x = torch.zeros(4, 33, dtype=dtype)
    y = decode(encode(x, codec, block=16, **kw))
    assert torch.equal(y, x) and not torch.isnan(y).any()


@pytest.mark.parametrize(("codec", "kw"), [CODECS[0], CODECS[1]])
def test_one_huge_outlier_only_hurts_its_block(codec, kw):
    x = _gen(8, 64, seed=3)
    x[2, 5] = 1e4  # flat index 133, block 2 of size 64
    y = decode(encode(x, codec, block=64, **kw))
    assert float(y[2, 5]) == pytest.approx(1e4, rel=0.07)
    xb, yb = x.reshape(-1, 64), y.reshape(-1, 64)
    others = [b for b in range(xb.shape[0]) if b != 2]
    assert _rel(xb[others], yb[others]) < 0.04  # the outlier's scale does not leak into other blocks


def test_outlier_channel_kept_in_bf16_and_helps():
    x = _gen(256, 64, seed=4)
    x[:, 9] *= 200.0  # one outlier channel (z-score >> 3)
    p = encode(x, "int4_outlier", block=64)
    idx = p.tensors[4]
    assert 9 in idx.tolist()  # valid slot for channel 9
    assert (idx < 0).sum() == len(idx) - 1  # other slot(s) not above the threshold: marked unused
    y = decode(p)
    assert torch.equal(y[:, 9], x[:, 9].to(torch.bfloat16).float())
    rest = [c for c in range(64) if c != 9]
    err_sep = _rel(x[:, rest], y[:, rest])
    y_plain = decode(encode(x, "int4_outlier", block=64, z_threshold=1e9))  # no separation
    err_plain = _rel(x[:, rest], y_plain[:, rest])
    assert err_sep < 0.15 and err_plain > 3 * err_sep


def test_one_sided_blocks_use_asymmetric_range():
    """Non-negative data (softmax / post-activation): error <= half a step of (max - min) / 15 per block."""
    x = torch.rand(32, 64, generator=torch.Generator().manual_seed(5))
    y = decode(encode(x, "int4_outlier", block=64, z_threshold=1e9))
    step = (x.amax(dim=1) - x.amin(dim=1)) / 15  # each row is one block (64 channels, block 64)
    assert ((x - y).abs() <= step[:, None] / 2 + 1e-6).all()
    # a symmetric 4-bit code would use step absmax / 7 ~ 2.1x larger; check we are well below it
    assert float((x - y).abs().max()) < float((x.abs().amax(dim=1) / 7 / 2).min())


@pytest.mark.parametrize(("codec", "kw"), CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_block_decodes_to_nan_and_the_others_as_without_it(codec, kw, bad):
    """A non-finite value is encoded without a host check: its block (16 elements: row 1, columns 0..15) decodes
    to NaN, so backward sees a non-finite value and the step is skipped; every other block decodes exactly as
    the same tensor with a finite value there (outlier codecs: with no outlier slot, so against z_threshold=inf)."""
    x = _gen(4, 32, seed=6)
    kw = {**kw, "z_threshold": math.inf} if "outlier" in codec else kw
    clean = decode(encode(x, codec, block=16, **kw))
    x[1, 3] = bad
    y = decode(encode(x, codec, block=16, **kw))
    assert torch.isnan(y[1, :16]).all(), y[1]
    others = torch.ones_like(x, dtype=torch.bool)
    others[1, :16] = False
    assert torch.equal(y[others], clean[others]), (y - clean).abs().max()


def test_non_finite_encode_does_not_synchronize():
    """Encoding a saved activation with a non-finite value waits for no device value (no ``.item()``/``bool``,
    ``nonzero``, boolean-mask indexing: ``experiments.dispatch_counter``)."""
    from experiments.dispatch_counter import DispatchCounter

    x = _gen(4, 32, seed=6)
    x[1, 3] = float("nan")
    for codec, kw in CODECS:
        counter = DispatchCounter()
        with counter:
            encode(x, codec, block=16, **kw)
        assert counter.report().host_syncs == 0, (codec, counter.report().sync_sites)


@pytest.mark.parametrize("block", [0, -4])
def test_bad_block_size_raises(block):
    with pytest.raises(ValueError, match="block_size"):
        encode(torch.ones(8), "int8", block=block)


def test_int4_needs_even_block():
    with pytest.raises(ValueError, match="block_size"):
        encode(torch.ones(4, 8), "int4_outlier", block=15)


def test_packed_bytes_match_layout():
    """INT8/FP8: 1 byte per element + 4 per block; INT4: 1/2 byte + 8 per block + BF16 outlier columns + idx."""
    x = _gen(3, 50, 100)  # 15000 elements, 150 rows x 100 channels
    nb = math.ceil(15000 / 128)
    assert packed_nbytes(encode(x, "int8", block=128)) == nb * 128 + 4 * nb
    assert packed_nbytes(encode(x, "fp8", block=128)) == nb * 128 + 4 * nb
    slots = outlier_slots(100, 1 / 32)
    assert slots == 4
    assert packed_nbytes(encode(x, "int4_outlier", block=128)) == nb * 64 + 8 * nb + 150 * slots * 2 + 8 * slots


@pytest.mark.parametrize(("codec", "kw"), CODECS)
def test_fake_impl_shapes_match_real(codec, kw):
    x = _gen(3, 5, 40)
    real = encode(x, codec, block=32, **kw)
    with FakeTensorMode():
        fx = torch.empty(3, 5, 40)
        fake = encode(fx, codec, block=32, **kw)
        fy = decode(fake)
    assert [t.shape for t in fake.tensors] == [t.shape for t in real.tensors]
    assert [t.dtype for t in fake.tensors] == [t.dtype for t in real.tensors]
    assert fy.shape == x.shape and fy.dtype == x.dtype


def test_opcheck_custom_ops():
    x = _gen(5, 24)
    torch.library.opcheck(torch.ops.hmt.int8_block_quant.default, (x, 16))
    torch.library.opcheck(torch.ops.hmt.fp8_block_quant.default, (x, 16, "e5m2"))
    torch.library.opcheck(torch.ops.hmt.outlier_quant.default, (x, 4, 16, 3.0, 2))
    q, s = int8_block_quant(x, 16)
    torch.library.opcheck(torch.ops.hmt.int8_block_dequant.default, (q, s, [5, 24], torch.float32))
    packed = outlier_quant(x, 4, 16, 3.0, 2)
    torch.library.opcheck(torch.ops.hmt.outlier_dequant.default, (*packed, 4, [5, 24], torch.bfloat16))
