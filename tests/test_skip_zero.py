"""``zeroed_where`` (the device-side skip's zeroing, ``hmt_core.optim.skip``) equals ``masked_fill(flag, 0)`` bit for
bit for every bit pattern of its input: NaN, ±inf, −0 and denormals included, flag True and False, contiguous rows
and strided views (which fall back to the masked fill)."""

from __future__ import annotations

import pytest
import torch

from hmt_core.optim.skip import zeroed_where

SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -2.0]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize == 2:  # all 65,536 bit patterns
        return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
    g = torch.Generator().manual_seed(0)
    random = torch.randint(-2**31, 2**31 - 1, (64 * 1024,), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.cat([torch.tensor(SPECIAL, dtype=dtype), random.view(dtype)]).reshape(-1, 1).repeat(1, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("skip", [False, True])
def test_zeroed_where_is_masked_fill_bit_for_bit(dtype: torch.dtype, skip: bool) -> None:
    x = _every_pattern(dtype)
    flag = torch.tensor(skip)
    for view in (x, x[3:], x[:, 1:], x.t(), x[0, 0]):
        got, want = zeroed_where(view, flag), view.masked_fill(flag, 0.0)
        assert got.dtype == want.dtype and got.shape == want.shape
        differ = (_bits(got) != _bits(want)).sum().item()
        assert differ == 0, f"{dtype} skip={skip} shape {tuple(view.shape)}: {differ} elements differ"


@pytest.mark.fake_cuda
@pytest.mark.skipif(torch.version.cuda is None, reason="fake-CUDA tier: needs the CUDA build of torch (docs/testing.md)")
def test_zeroed_where_on_fake_cuda_is_one_integer_addcmul_like_the_masked_fill() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        for dtype in (torch.float32, torch.bfloat16):
            d = torch.randn(64, 32, device="cuda", dtype=dtype)
            flag = torch.zeros((), dtype=torch.bool, device="cuda")
            with Ops() as ops:
                got = zeroed_where(d, flag)
            want = d.masked_fill(flag, 0.0)
            assert (got.dtype, got.shape, got.stride(), got.device) == (want.dtype, want.shape, want.stride(),
                                                                        want.device), (got, want)
            assert [n for n in ops.names if n not in ("view", "detach")] == ["addcmul"], ops.names  # views aside
