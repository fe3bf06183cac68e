"""Triton kernels vs their PyTorch fallbacks, run on CPU in Triton's interpreter.

TRITON_INTERPRET=1 is set here, before ``hmt_core.kernels.quant`` / ``lowrank`` (whose ``@triton.jit`` decide
interpreter vs compiler when they are decorated) are imported; nothing else imports them on CPU. triton is
required: without it this module fails to import (CI installs it), it is never skipped.

Codecs must be bit-identical to ``hmt_core.activations.codecs`` (codes, scales and dequantized values compared as
bit patterns). The low-rank kernels accumulate in fp32 in another order than BLAS, so they are compared with
tight tolerances (fp32) or against an fp64 reference with one bf16 rounding (bf16).
"""

import os
import subprocess
import sys
import textwrap

os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
except ImportError as err:  # a clear failure, not a skip: CI installs triton (pyproject's test extra)
    raise ImportError("tests/test_kernels.py needs triton (pip install -e '.[test]')") from err

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.memory.update_temporaries import update_temp_bytes
from hmt_core import kernels, precision
from hmt_core.activations import codecs as C
from hmt_core.kernels import ops, quant
from hmt_core.optim import update as upd
from hmt_core.projection import Basis

# numpy's warnings from the interpreter's casts: fp16 dequant overflowing to inf (as torch does) and the NaN
# quotients of a non-finite block (its codes are then set to 0)
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered in cast:RuntimeWarning")


def _bits(t):
    return t.contiguous().view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _codec(x, block, fmt, backend):
    with kernels.using(backend):
        return C.int8_block_quant(x, block) if fmt == "int8" else C.fp8_block_quant(x, block, fmt)


def _assert_codec_bit_identical(x, block, fmt, out_dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    ref_q, ref_s = _codec(x, block, fmt, "torch")
    got_q, got_s = _codec(x, block, fmt, "triton")
    assert got_q.dtype == ref_q.dtype and got_q.shape == ref_q.shape and got_s.shape == ref_s.shape
    assert torch.equal(_bits(got_q), _bits(ref_q)), f"codes differ: {fmt} block={block} {x.dtype} {tuple(x.shape)}"
    assert torch.equal(_bits(got_s), _bits(ref_s)), f"scales differ: {fmt} block={block}"
    deq = C.int8_block_dequant if fmt == "int8" else C.fp8_block_dequant
    for dt in out_dtypes:
        with kernels.using("torch"):
            ref = deq(ref_q, ref_s, list(x.shape), dt)
        with kernels.using("triton"):
            got = deq(ref_q, ref_s, list(x.shape), dt)
        assert got.dtype == dt and got.shape == x.shape
        assert torch.equal(_bits(got), _bits(ref)), f"dequant differs: {fmt} block={block} -> {dt}"


def test_kernels_run_in_the_interpreter_and_auto_stays_on_torch_for_cpu():
    assert type(quant._block_quant_kernel).__name__ == "InterpretedFunction"
    x = torch.randn(10)
    assert not kernels.use_triton(x, backend="auto") and not kernels.use_triton(x, backend="torch")
    assert kernels.use_triton(x, backend="triton")
    with pytest.raises(ValueError, match="kernels backend"):
        kernels.use_triton(x, backend="cuda")


SHAPES = [(1,), (7,), (3, 33), (5, 17, 9), (4097,)]
BLOCKS = [1, 7, 64, 100, 3000]  # 3000 > the kernel's 2048-column chunk: the looped path


@pytest.mark.parametrize("fmt", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codec_kernels_bit_identical_on_odd_shapes_and_blocks(fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        for block in BLOCKS:
            # magnitudes spread over 9 decades inside one tensor, so blocks differ in scale
            x = torch.randn(shape, generator=gen) * torch.logspace(-6, 3, shape[-1])
            _assert_codec_bit_identical(x.to(dtype), block, fmt, out_dtypes=(dtype,))


@pytest.mark.parametrize("fmt", ["int8", "e4m3", "e5m2"])
def test_codec_kernels_bit_identical_on_edge_values(fmt):
    gen = torch.Generator().manual_seed(1)
    raw = torch.randint(-2**31, 2**31 - 1, (20000,), generator=gen, dtype=torch.int64).to(torch.int32)
    raw = raw.view(torch.float32)
    raw = raw[torch.isfinite(raw)]  # every finite fp32 bit pattern class: subnormals, huge, tiny, both signs
    _assert_codec_bit_identical(raw, 64, fmt)
    _assert_codec_bit_identical(raw, 1, fmt, out_dtypes=(torch.float32,))  # scale = |x|/q_max per element
    ties = torch.tensor([2.5, -2.5, 0.5, -0.5, 1.5, 126.5, -127.0, 127.0, 3.5, 0.0, -0.0, 1e-30, -1e-38])
    _assert_codec_bit_identical(ties, 13, fmt)  # absmax 127: x / s hits integer ties exactly
    _assert_codec_bit_identical(ties, 4, fmt)
    fp8_grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    fp8_grid = fp8_grid[torch.isfinite(fp8_grid)]
    mids = (fp8_grid.sort().values[1:] + fp8_grid.sort().values[:-1]) / 2  # fp8 rounding midpoints
    _assert_codec_bit_identical(torch.cat([fp8_grid, mids]), 512, fmt)  # absmax 448 -> scale 1: exact ties
    _assert_codec_bit_identical(torch.zeros(37), 8, fmt)  # all-zero blocks: scale 1
    _assert_codec_bit_identical(-torch.full((37,), 3.0), 8, fmt)  # one-signed constant blocks
    _assert_codec_bit_identical(torch.tensor([-0.0] * 5), 2, fmt)  # negative zero keeps its fp8 sign bit


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_codec_kernels_encode_nonfinite_like_the_reference(bad, fmt):
    """A non-finite block (elements 192..255): scale NaN and codes 0 in both backends, bit for bit."""
    x = torch.randn(300)
    x[211] = bad
    _assert_codec_bit_identical(x, 64, fmt, out_dtypes=(torch.float32,))
    q, s = _codec(x, 64, fmt, "triton")
    assert torch.isnan(s[3]) and torch.isfinite(s[[0, 1, 2, 4]]).all() and not _bits(q[3]).any(), s


def test_codec_kernels_empty_and_fake_tensors():
    q, s = _codec(torch.empty(0, 5), 16, "int8", "triton")
    assert q.shape == (0, 16) and s.shape == (0,)
    with kernels.using("triton"):
        assert C.int8_block_dequant(q, s, [0, 5], torch.bfloat16).shape == (0, 5)
        with FakeTensorMode():  # the registered fakes answer; no kernel runs on fake tensors
            p = C.encode(torch.randn(3, 50), "fp8", block=16)
            assert p.tensors[0].shape == (10, 16) and C.decode(p).shape == (3, 50)


# ------------------------------------------------------------------------------------------------ low rank
def _basis(o, i, r, sides, dtype, gen):
    left = torch.randn(o, r, generator=gen).div_(r ** 0.5).to(dtype) if sides != "right" else None
    right = torch.randn(r, i, generator=gen).div_(r ** 0.5).to(dtype) if sides != "left" else None
    return Basis(left, right)


def _low_shape(o, i, basis):
    return upd.low_rank_shape(basis, (o, i))


LOWRANK_SHAPES = [(37, 29, 5), (64, 48, 16), (70, 101, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["torch", "hf"])
def test_fused_update_kernel_matches_fallback(dtype, style):
    gen = torch.Generator().manual_seed(2)
    for (o, i, r) in LOWRANK_SHAPES:
        for sides in ("left", "right", "both"):
            basis = _basis(o, i, r, sides, dtype, gen)
            direction = torch.randn(_low_shape(o, i, basis), generator=gen)
            w0 = torch.randn(o, i, generator=gen).to(dtype)
            kw = dict(scale=0.25, step_size=0.03, lr=0.01, weight_decay=0.1, style=style)
            w_kernel, w_fallback = w0.clone(), w0.clone()
            ops.lowrank_update(w_kernel, direction, basis, backend="triton", **kw)
            ops.lowrank_update(w_fallback, direction, basis, backend="torch", **kw)
            a, b = ops.factors(direction, basis)  # the kernel's inputs; fp64 reference of the fused formula
            w64, full = w0.double(), 0.03 * 0.25 * (a.double() @ b.double())
            ref = (w64 - full) * (1 - 0.001) if style == "hf" else w64 * (1 - 0.001) - full
            if dtype == torch.float32:
                torch.testing.assert_close(w_kernel, w_fallback, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(w_kernel.double(), ref, rtol=1e-6, atol=1e-6)
            else:  # the kernel rounds once to bf16: within half an ulp (+ fp32 slack) of the fp64 value
                ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
                assert ((w_kernel.double() - ref).abs() <= 0.5 * ulp + 1e-6 * ref.abs()).all(), (o, i, r, sides)
                big = torch.maximum(torch.maximum(w64.abs(), full.abs()), ref.abs())  # fallback rounds 3 times
                big_ulp = torch.exp2(torch.floor(torch.log2(big.clamp_min(1e-30))) - 7)
                assert ((w_fallback.double() - ref).abs() <= 2 * big_ulp).all()


def test_chunked_fallback_equals_unfused_update_exactly_with_one_chunk_and_closely_with_many():
    gen = torch.Generator().manual_seed(3)
    for sides in ("left", "right", "both"):
        for style in ("torch", "hf"):
            basis = _basis(53, 31, 6, sides, torch.float32, gen)
            direction = torch.randn(_low_shape(53, 31, basis), generator=gen)
            w0 = torch.randn(53, 31, generator=gen)
            unfused = w0.clone()
            upd.apply_update_(unfused, upd.project_back_scaled(direction, basis, 0.25), step_size=0.03, lr=0.01,
                              weight_decay=0.1, style=style)
            kw = dict(scale=0.25, step_size=0.03, lr=0.01, weight_decay=0.1, style=style, backend="torch")
            one, many = w0.clone(), w0.clone()
            ops.lowrank_update(one, direction, basis, **kw)  # default budget: one chunk for this size
            ops.lowrank_update(many, direction, basis, chunk_rows=7, **kw)
            assert torch.equal(one, unfused)
            torch.testing.assert_close(many, unfused, rtol=1e-6, atol=1e-6)
            assert not torch.equal(many, w0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_kernel_matches_fallback(dtype):
    gen = torch.Generator().manual_seed(4)
    for (o, i, r) in LOWRANK_SHAPES:
        for sides in ("left", "right", "both"):
            basis = _basis(o, i, r, sides, dtype, gen)
            grad = torch.randn(o, i, generator=gen).to(dtype)
            got = ops.project(grad, basis, backend="triton")
            ref = ops.project(grad, basis, backend="torch")
            assert got.dtype == ref.dtype and got.shape == ref.shape
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max())


@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["torch", "hf"])
def test_adam_kernel_matches_fallback(state, style):
    gen = torch.Generator().manual_seed(5)
    for shape, beta1, t in [((33, 17), 0.9, 1), ((5, 130), 0.9, 7), ((16, 16), 0.3, 3)]:  # β₁=0.3: lerp's other branch
        m0 = torch.randn(shape, generator=gen).to(state)
        v0 = torch.rand(shape, generator=gen).to(state)
        g = torch.randn(shape, generator=gen)
        m1, v1, m2, v2 = m0.clone(), v0.clone(), m0.clone(), v0.clone()
        kw = dict(lr=0.01, beta1=beta1, beta2=0.999, eps=1e-8, style=style)
        d_kernel, s_kernel = ops.adam_step(m1, v1, g, t, backend="triton", **kw)
        d_ref, s_ref = ops.adam_step(m2, v2, g, t, backend="torch", **kw)
        assert s_kernel == pytest.approx(s_ref, rel=1e-12)
        torch.testing.assert_close(d_kernel, d_ref, rtol=1e-5, atol=1e-7)
        tol = 1e-6 if state == torch.float32 else 2 ** -8  # bf16 state: at most one rounding flip
        torch.testing.assert_close(m1.float(), m2.float(), rtol=tol, atol=1e-7)
        torch.testing.assert_close(v1.float(), v2.float(), rtol=tol, atol=1e-7)
        assert not torch.equal(m1, m0)


def test_custom_ops_have_consistent_fakes():
    gen = torch.Generator().manual_seed(6)
    w, a, b = torch.randn(20, 12, generator=gen), torch.randn(20, 4, generator=gen), torch.randn(4, 12, generator=gen)
    m, v, g = torch.randn(4, 12, generator=gen), torch.rand(4, 12, generator=gen), torch.randn(4, 12, generator=gen)
    checks = ("test_schema", "test_faketensor")
    for backend in ("torch", "triton"):
        torch.library.opcheck(torch.ops.hmt.lowrank_update_, (w, a, b, 0.5, 0.1, 0.01, False, 0, backend),
                              test_utils=checks)
        torch.library.opcheck(torch.ops.hmt.project, (w, a, None, backend), test_utils=checks)
        torch.library.opcheck(torch.ops.hmt.project, (w, a, b, backend), test_utils=checks)
        torch.library.opcheck(torch.ops.hmt.adam_lowrank_, (m, v, g, 2, 0.01, 0.9, 0.999, 1e-8, True, backend),
                              test_utils=checks)


def test_torch_compile_traces_the_ops_without_graph_breaks():
    def step(w, a, b, x):
        torch.ops.hmt.lowrank_update_(w, a, b, 0.5, 0.1, 0.01, False, 0, "torch")
        q, s = C.int8_block_quant(x, 16)
        return torch.ops.hmt.project(w, a, None, "torch"), C.int8_block_dequant(q, s, [3, 10], torch.float32)

    gen = torch.Generator().manual_seed(7)
    w, a, b, x = (torch.randn(s, generator=gen) for s in ((20, 12), (20, 4), (4, 12), (3, 10)))
    w_eager = w.clone()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(w, a, b, x)  # fullgraph: no breaks
    eager = step(w_eager, a, b, x)
    assert torch.equal(w, w_eager) and all(torch.equal(c, e) for c, e in zip(compiled, eager, strict=True))


def test_optimizer_step_with_triton_kernels_matches_torch_fallback():
    from hmt_core import hmt

    def run(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.add_module("mlp", torch.nn.Linear(24, 40, bias=False))
        model.add_module("attn", torch.nn.Linear(40, 24, bias=False))
        method = hmt.make(hmt.Config(rank=4, basis="svd", weight_decay=0.1, update_interval=2, per_layer=False))
        method.attach(model, max_grad_norm=1.0)
        with kernels.using(backend):
            for _ in range(3):
                model(torch.randn(6, 24)).pow(2).mean().backward()
                method.step()
                method.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for got, ref in zip(run("triton"), run("torch"), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- memory bound
def _update_temp_bytes(o, i, r, *, naive, dtype=torch.float32, fake=True, chunk_rows=0):
    return update_temp_bytes(o, i, r, naive=naive, dtype=dtype, fake=fake, chunk_rows=chunk_rows)[0]


def test_chunked_fallback_bounds_temporaries_on_a_7b_mlp_matrix():
    o, i, r = 11008, 4096, 256  # LLaMA-7B MLP weight, fp32, under FakeTensorMode (no real memory)
    naive = _update_temp_bytes(o, i, r, naive=True)
    chunked = _update_temp_bytes(o, i, r, naive=False)
    full = o * i * 4
    assert naive >= 2 * full  # P U Qᵀ and lr·(P U Qᵀ) alive together
    chunk = precision.chunk_rows_for((o, i), torch.float32) * i * 4  # CPU tensors: the host budget
    assert chunk == precision.CHUNK_BYTES and chunked <= chunk + r * i * 4  # one row chunk + U Qᵀ (r, in)
    assert chunked < full / 8


def test_chunk_bound_measured_on_real_cpu_tensors():
    naive = _update_temp_bytes(300, 200, 8, naive=True, fake=False)
    chunked = _update_temp_bytes(300, 200, 8, naive=False, fake=False, chunk_rows=40)
    assert naive >= 2 * 300 * 200 * 4 and chunked <= 40 * 200 * 4 + 8 * 200 * 4


def test_fallback_works_and_triton_backend_fails_clearly_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as if triton were not installed
        import torch
        from hmt_core import kernels
        from hmt_core.activations import codecs as C
        from hmt_core.kernels import ops
        from hmt_core.projection import Basis
        assert not kernels.triton_available()
        x = torch.randn(5, 7)
        p = C.encode(x, "int8", block=16)
        assert C.decode(p).shape == (5, 7)
        w = torch.randn(9, 7)
        ops.lowrank_update(w, torch.randn(9, 2), Basis(None, torch.randn(2, 7)), scale=1.0, step_size=0.1, lr=0.1,
                           weight_decay=0.0, style="torch")
        try:
            with kernels.using("triton"):
                C.encode(x, "int8", block=16)
        except RuntimeError as err:
            assert "not installed" in str(err)
            print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ------------------------------------------------------------------------------------- INT8 weight dequantization
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_weight_dequant_kernel_bit_identical(dtype):
    """hmt_core.kernels.int8_weight vs the PyTorch fallback: codes and block scales of weights whose rows end in a
    shorter block (300 = 4·64 + 44), one block per row (block ≥ cols), blocks of 1, a row slice (an optimizer's
    chunk) and magnitudes over 9 decades; the Int8Linear built on it gives the same forward and gradients."""
    from hmt_core.int8_weights import Int8Linear, dequantize, quantize

    gen = torch.Generator().manual_seed(0)
    for rows, cols, block in ((7, 300, 64), (5, 256, 256), (3, 17, 1), (33, 130, 512), (1, 1, 256)):
        w = torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 3, cols)
        q, s = quantize(w, block)
        for index in (..., slice(1, max(2, rows - 1))):
            with kernels.using("torch"):
                ref = dequantize(q[index], s[index], block, dtype)
            with kernels.using("triton"):
                got = dequantize(q[index], s[index], block, dtype)
            assert got.dtype == dtype and got.shape == ref.shape
            assert torch.equal(_bits(got), _bits(ref)), (rows, cols, block, dtype, index)
    x = torch.randn(2, 3, 40, generator=gen).to(dtype)
    results = []
    for backend in ("torch", "triton"):
        torch.manual_seed(1)
        layer = Int8Linear.from_module(torch.nn.Linear(40, 24).to(dtype), block=16, backend=backend)
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.float().square().sum().backward()
        results.append([out, xi.grad, layer.weight.grad, layer.bias.grad])
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*results))
    with FakeTensorMode():  # the custom op's fake answers shape and dtype
        q, s = torch.empty(6, 70, dtype=torch.int8), torch.empty(6, 2)
        out = torch.ops.hmt.int8_weight_dequant(q, s, 64, dtype, "triton")
        assert out.shape == (6, 70) and out.dtype == dtype
