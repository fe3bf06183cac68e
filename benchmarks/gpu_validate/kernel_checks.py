"""CUDA worker: every Triton kernel of ``hmt_core.kernels`` compiled on the GPU and compared with its PyTorch
reference, the timings of kernel vs fallback, and the basis refresh by randomized vs exact SVD.

    python -m benchmarks.gpu_validate.kernel_checks {kernels|rsvd} --out FILE.json

Returns raw measurements only; ``checks.kernel_record`` judges them (so the tolerances are unit-tested on CPU):

- ``codec/{int8,e4m3,e5m2}``: blockwise quantize + dequantize on fp32/bf16/fp16 inputs spread over 9 decades, block
  sizes 64/128/3000 (3000: the kernel's looped path), plus random finite fp32 bit patterns; codes, scales and
  dequantized values compared as bit patterns (as ``tests/test_kernels.py`` does in the interpreter on CPU);
- ``fused_update/{bf16,fp32}``: ``W ← (1 − ηλ)W − c·P(U Qᵀ)`` on a LLaMA-7B MLP matrix (11008×4096, r = 256),
  kernel and fallback against an fp64 reference (bf16: error over the bound of fp32 arithmetic rounded once to
  bf16, ``fp32_then_bf16_bound``; the error in bf16 ulps of the result is kept beside it);
- ``projection/bf16``: ``G Q`` (11008×4096, r = 256), kernel vs fallback relative to the largest value;
- ``adam/fp32``: the low-rank Adam moments and direction (11008×256), kernel vs fallback.

Timings are medians of ``benchmarks.kernel_bench._bench`` (``triton.testing.do_bench``; in-place ops re-armed
before every call) with the peak extra CUDA memory of one call. Each check is guarded: a crash becomes
``{"name", "error"}`` and the next check runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

MIB = 1 << 20
SHAPE_OUT, SHAPE_IN, RANK = 11008, 4096, 256


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _timed(name: str, fn_by_backend: dict, reset=None) -> dict:
    from benchmarks.kernel_bench import _bench

    out = {}
    for backend, key in (("triton", "kernel"), ("torch", "fallback")):
        ms, extra = _bench(fn_by_backend[backend], reset)
        out[f"{name}{key}(ms)"], out[f"{name}{key}_extra(MiB)"] = ms, extra / MIB
    return out


def codec_check(fmt: str, *, device: str = "cuda", rows: int = 64, cols: int = 5000, timings: bool = True) -> dict:
    """``rows``/``cols``/``device``/``timings``: the tests run this small on CPU in Triton's interpreter."""
    from hmt_core import kernels
    from hmt_core.activations import codecs

    def encode(x, block, backend):
        with kernels.using(backend):
            return codecs.int8_block_quant(x, block) if fmt == "int8" else codecs.fp8_block_quant(x, block, fmt)

    def decode(q, s, shape, dtype, backend):
        with kernels.using(backend):
            deq = codecs.int8_block_dequant if fmt == "int8" else codecs.fp8_block_dequant
            return deq(q, s, shape, dtype)

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 3, cols)
    raw = torch.randint(-2**31, 2**31 - 1, (4 * cols,), generator=gen, dtype=torch.int64).to(torch.int32)
    raw = raw.view(torch.float32)
    cases = [(spread.to(dt), block) for dt in (torch.float32, torch.bfloat16, torch.float16)
             for block in (64, 128, 3000)]
    cases.append((raw[torch.isfinite(raw)], 64))
    mismatches = []
    for x, block in cases:
        x = x.to(dev)
        ref_q, ref_s = encode(x, block, "torch")
        got_q, got_s = encode(x, block, "triton")
        same = torch.equal(_bits(ref_q), _bits(got_q)) and torch.equal(_bits(ref_s), _bits(got_s))
        same = same and torch.equal(_bits(decode(ref_q, ref_s, list(x.shape), x.dtype, "torch")),
                                    _bits(decode(ref_q, ref_s, list(x.shape), x.dtype, "triton")))
        if not same:
            mismatches.append(f"{str(x.dtype).removeprefix('torch.')} block={block}")
    out = {"name": f"codec/{fmt}", "bit_identical": not mismatches, "mismatches": mismatches, "cases": len(cases)}
    if not timings:
        return out
    big = torch.randn(8, 1024, 4096, device=dev, dtype=torch.bfloat16)  # a saved activation, 64 MiB
    q, s = encode(big, 128, "torch")
    out.update(_timed("quant_", {b: (lambda b=b: encode(big, 128, b)) for b in ("triton", "torch")}))
    out.update(_timed("dequant_", {b: (lambda b=b: decode(q, s, list(big.shape), big.dtype, b))
                                   for b in ("triton", "torch")}))
    out["kernel(ms)"] = out["quant_kernel(ms)"] + out["dequant_kernel(ms)"]
    out["fallback(ms)"] = out["quant_fallback(ms)"] + out["dequant_fallback(ms)"]
    return out


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:  # x ≥ 0 (fp64) -> the bf16 ulp of its binade (8 significant bits)
    return torch.exp2(torch.floor(torch.log2(x.clamp_min(1e-30))) - 7)


def fp32_then_bf16_bound(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, *, decay: float,
                         coef: float) -> torch.Tensor:
    """Largest error of ``W(1 − d) − c·(A B)`` computed in fp32 and rounded once to bf16, against the fp64 ``ref``:
    the k-term dot product's accumulation (γ_k = k·u / (1 − k·u), Higham 2002, Eq. 3.5) plus a few fp32 roundings
    (the products, the difference, c and 1 − d held in fp32) and the final bf16 rounding (half a bf16 ulp).
    w0: (out, in), a: (out, k), b: (k, in), ref: (out, in) fp64. A bound relative to the operands, not the
    result: where W(1 − d) and c·A B nearly cancel, fp32 alone is many bf16 ulps of the small result."""
    u, k = 2.0**-24, a.shape[1]
    gamma = k * u / (1 - k * u)
    ab = a.double().abs() @ b.double().abs()  # (out, in)
    fp32 = (gamma + 3 * u) * coef * ab + 3 * u * (w0.double().abs() * (1 - decay))
    return fp32 + 0.5 * _bf16_ulp(ref.abs() + fp32)


def fused_update_check(dtype: torch.dtype, *, device: str = "cuda",
                       shape: tuple[int, int, int] = (SHAPE_OUT, SHAPE_IN, RANK), timings: bool = True) -> dict:
    from hmt_core.kernels import ops
    from hmt_core.projection import Basis

    dev, (o, i, r) = torch.device(device), shape
    gen = torch.Generator(device=dev).manual_seed(2)
    w0 = torch.randn(o, i, device=dev, generator=gen).to(dtype)
    basis = Basis((torch.randn(o, r, device=dev, generator=gen) / r**0.5).to(dtype),
                  (torch.randn(r, i, device=dev, generator=gen) / r**0.5).to(dtype))
    u = torch.randn(r, r, device=dev, generator=gen)
    kw = dict(scale=0.25, step_size=0.03, lr=0.01, weight_decay=0.1, style="torch")
    results = {}
    for backend in ("triton", "torch"):
        w = w0.clone()
        ops.lowrank_update(w, u, basis, backend=backend, **kw)
        results[backend] = w
    a, b = ops.factors(u, basis)  # the kernel's inputs; fp64 reference of the fused formula
    ref = w0.double() * (1 - 0.01 * 0.1) - 0.03 * 0.25 * (a.double() @ b.double())
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    out = {"name": f"fused_update/{name}", "shape": [o, i], "rank": r}
    if dtype == torch.bfloat16:
        allowed = fp32_then_bf16_bound(w0, a, b, ref, decay=0.01 * 0.1, coef=0.03 * 0.25)
        ulp = _bf16_ulp(ref.abs())
        for key, got in (("", results["triton"]), ("fallback_", results["torch"])):
            err = (got.double() - ref).abs()
            out[f"{key}max_err(fp32 bound)"] = float((err / allowed).max())
            out[f"{key}max_err(bf16 ulp)"] = float((err / ulp).max())
    else:
        top = float(ref.abs().max())
        out["max_rel_err"] = float((results["triton"].double() - ref).abs().max()) / top
        out["fallback_max_rel_err"] = float((results["torch"].double() - ref).abs().max()) / top
    del results, ref, a, b
    if not timings:
        return out
    w = w0.clone()
    out.update(_timed("", {bk: (lambda bk=bk: ops.lowrank_update(w, u, basis, backend=bk, **kw))
                           for bk in ("triton", "torch")}, reset=lambda: w.copy_(w0)))
    return out


def projection_check(*, device: str = "cuda", shape: tuple[int, int, int] = (SHAPE_OUT, SHAPE_IN, RANK),
                     timings: bool = True) -> dict:
    from hmt_core.kernels import ops
    from hmt_core.projection import Basis

    dev, (o, i, r) = torch.device(device), shape
    gen = torch.Generator(device=dev).manual_seed(4)
    g = torch.randn(o, i, device=dev, generator=gen).to(torch.bfloat16)
    basis = Basis(None, (torch.randn(r, i, device=dev, generator=gen) / r**0.5).to(torch.bfloat16))
    got, ref = ops.project(g, basis, backend="triton").float(), ops.project(g, basis, backend="torch").float()
    out = {"name": "projection/bf16", "shape": [o, i], "rank": r,
           "max_rel_err": float((got - ref).abs().max()) / float(ref.abs().max())}
    if not timings:
        return out
    out.update(_timed("", {b: (lambda b=b: ops.project(g, basis, backend=b)) for b in ("triton", "torch")}))
    return out


def adam_check(*, device: str = "cuda", shape: tuple[int, int] = (SHAPE_OUT, RANK), timings: bool = True) -> dict:
    from hmt_core.kernels import ops

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(5)
    m0, v0 = torch.randn(shape, device=dev, generator=gen), torch.rand(shape, device=dev, generator=gen)
    g = torch.randn(shape, device=dev, generator=gen)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, style="torch")
    outs = {}
    for backend in ("triton", "torch"):
        m, v = m0.clone(), v0.clone()
        d, _ = ops.adam_step(m, v, g, 5, backend=backend, **kw)
        outs[backend] = (d, m, v)
    err = max(float((k - t).abs().max()) / max(float(t.abs().max()), 1e-30)
              for k, t in zip(outs["triton"], outs["torch"], strict=True))
    out = {"name": "adam/fp32", "shape": list(shape), "max_rel_err": err}
    if not timings:
        return out
    m, v = m0.clone(), v0.clone()
    out.update(_timed("", {b: (lambda b=b: ops.adam_step(m, v, g, 5, backend=b, **kw)) for b in ("triton", "torch")},
                      reset=lambda: (m.copy_(m0), v.copy_(v0))))
    return out


def run_kernel_checks() -> list[dict]:
    from hmt_core import kernels

    checks = [("codec/int8", lambda: codec_check("int8")), ("codec/e4m3", lambda: codec_check("e4m3")),
              ("codec/e5m2", lambda: codec_check("e5m2")),
              ("fused_update/bf16", lambda: fused_update_check(torch.bfloat16)),
              ("fused_update/fp32", lambda: fused_update_check(torch.float32)),
              ("projection/bf16", projection_check), ("adam/fp32", adam_check)]
    if not kernels.triton_available():
        return [{"name": n, "error": "triton is not installed (pip install 'hmt[triton]')"} for n, _ in checks]
    if kernels.interpreting():
        return [{"name": n, "error": "TRITON_INTERPRET=1: the kernels would run in Triton's interpreter, not compiled"}
                for n, _ in checks]
    results = []
    for name, fn in checks:
        try:
            results.append(fn())
        except Exception as e:
            traceback.print_exc()
            results.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})
        torch.cuda.empty_cache()
    return results


def rsvd_vs_svd(out_dim: int = 4096, in_dim: int = 11008, rank: int = 256, components: int = 2048,
                repeats: int = 3, device: str = "cuda") -> dict:
    """HMT's randomized SVD (q = 2 power iterations, p = 8) vs ``torch.linalg.svd`` (via ``exact_svd``) on a
    matrix with a power-law spectrum σ_i = 1/i (as ``benchmarks/optimizer_bench.py``), fp32 on the GPU."""
    from hmt_core import projection as proj

    try:
        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(0)
        s = torch.arange(1, components + 1, dtype=torch.float32, device=dev) ** -1.0
        g = (torch.randn(out_dim, components, device=dev, generator=gen) * s) @ torch.randn(
            components, in_dim, device=dev, generator=gen) / in_dim**0.5
        g += 1e-4 * torch.randn(out_dim, in_dim, device=dev, generator=gen)
        proj.exact_svd(g[:256, :512], min(8, rank))  # cuSOLVER / cuBLAS handles created outside the timed calls
        proj.randomized_svd(g, rank, generator=torch.Generator().manual_seed(1))
        _sync(dev)
        t0 = time.perf_counter()
        exact = proj.exact_svd(g, rank)
        _sync(dev)
        t_svd = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f = proj.randomized_svd(g, rank, power_iters=2, oversample=8, generator=torch.Generator().manual_seed(1))
            _sync(dev)
            times.append(time.perf_counter() - t0)
        if exact is None or f is None:
            return {"error": "exact_svd or randomized_svd returned None (non-finite values or a solver failure)"}
        top = float((exact.s.double() ** 2).sum())
        captured = float(torch.linalg.vector_norm((g @ f.vh.t()).double()) ** 2) / top
        t_rsvd = statistics.median(times)
        return {"shape": [out_dim, in_dim], "rank": rank, "svd(s)": t_svd, "rsvd(s)": t_rsvd,
                "speedup(x)": t_svd / t_rsvd, "captured/exact_top_r_energy": captured}
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("kernels", "rsvd"))
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    from experiments.results import atomic_write_text, dumps

    result = run_kernel_checks() if a.what == "kernels" else rsvd_vs_svd()
    atomic_write_text(a.out, json.dumps(json.loads(dumps(result)), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
