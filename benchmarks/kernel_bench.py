"""Kernel benchmark (not a test): Triton kernels vs their PyTorch fallbacks.

    python benchmarks/kernel_bench.py [--real] [--skip-e2e] [--steps 10]

1. Memory bound of the fused update's fallback (any machine): ``experiments.memory.meter.MemoryMeter``'s peak
   temporary bytes of the naive ``W -= lr * (P @ U @ Q.T)`` vs the row-chunked fallback
   (``hmt_core.kernels.ops.lowrank_update_torch``) on a LLaMA-7B MLP matrix (11008 × 4096, r = 256), traced
   under FakeTensorMode (no memory used); ``--real`` also measures fp32 on real CPU tensors (~0.6 GB RAM).
2. GPU only: per op (blockwise INT8/FP8 quantize + dequantize, fused low-rank update, projection, low-rank
   Adam), median time (``triton.testing.do_bench``) and peak extra CUDA memory, kernel vs fallback; then
   end-to-end training tokens/s of a small LLaMA with HMT Mode A and INT8 activation codecs, backend
   "triton" vs "torch". Without a CUDA GPU this part says so and the script exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.memory.update_temporaries import update_temp_bytes  # noqa: E402
from hmt_core import kernels, precision  # noqa: E402
from hmt_core.activations import codecs  # noqa: E402
from hmt_core.kernels import ops  # noqa: E402
from hmt_core.projection import Basis  # noqa: E402

MIB = 1 << 20


def memory_section(real: bool) -> None:
    o, i, r = 11008, 4096, 256
    print(f"== fused-update fallback temporaries: W ({o}x{i}) -= lr * P({o}x{r}) U({r}x{r}) Q({i}x{r})^T")
    print(f"   chunk budget {precision.CHUNK_BYTES // MIB} MiB per row chunk (CPU); meter category 'temp' at the peak")
    runs = [(torch.float32, True), (torch.bfloat16, True)] + ([(torch.float32, False)] if real else [])
    for dtype, fake in runs:
        full = o * i * dtype.itemsize
        naive, _ = update_temp_bytes(o, i, r, naive=True, dtype=dtype, fake=fake)
        chunked, _ = update_temp_bytes(o, i, r, naive=False, dtype=dtype, fake=fake)
        rows = precision.chunk_rows_for((o, i), dtype)
        print(f"   {str(dtype):15s} {'fake' if fake else 'real'}: naive {naive:>11,d} B ({naive / MIB:7.1f} MiB)  "
              f"chunked {chunked:>11,d} B ({chunked / MIB:6.1f} MiB)  ratio {naive / max(chunked, 1):5.1f}x  "
              f"[full W {full / MIB:.1f} MiB, {rows} rows/chunk]")


# ------------------------------------------------------------------------------------------------------ GPU
def _bench(fn, reset=None) -> tuple[float, int]:
    """(median ms, peak extra CUDA bytes over what was allocated before the call)."""
    import triton.testing

    fn()  # compile / warm up
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=5, rep=50) if reset is None else _timed_with_reset(fn, reset)
    if reset is not None:
        reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return ms, torch.cuda.max_memory_allocated() - base


def _timed_with_reset(fn, reset, n: int = 20) -> float:
    times = []
    for _ in range(n):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def _row(name: str, results: dict) -> None:
    k_ms, k_mem = results["triton"]
    t_ms, t_mem = results["torch"]
    print(f"   {name:38s} triton {k_ms:8.3f} ms {k_mem / MIB:8.1f} MiB | torch {t_ms:8.3f} ms {t_mem / MIB:8.1f} MiB "
          f"| speedup {t_ms / k_ms:5.2f}x")


def ops_section() -> None:
    dev = torch.device("cuda")
    print(f"== per-op: {torch.cuda.get_device_name()} (median ms, peak extra allocated MiB)")
    x = torch.randn(8, 2048, 4096, device=dev, dtype=torch.bfloat16)  # a saved activation, 128 MiB
    for fmt in ("int8", "e4m3"):
        res_q, res_d = {}, {}
        for backend in ("triton", "torch"):
            with kernels.using(backend):
                enc = (lambda: codecs.int8_block_quant(x, 128)) if fmt == "int8" else \
                    (lambda: codecs.fp8_block_quant(x, 128, fmt))
                q, s = enc()
                dec = codecs.int8_block_dequant if fmt == "int8" else codecs.fp8_block_dequant
                res_q[backend] = _bench(enc)
                res_d[backend] = _bench(lambda: dec(q, s, list(x.shape), x.dtype))
        _row(f"{fmt} quant  {tuple(x.shape)} bf16 B=128", res_q)
        _row(f"{fmt} dequant", res_d)
    o, i, r = 11008, 4096, 256
    w0 = torch.randn(o, i, device=dev, dtype=torch.bfloat16)
    w = w0.clone()
    basis = Basis(torch.randn(o, r, device=dev, dtype=torch.bfloat16), torch.randn(r, i, device=dev,
                                                                                   dtype=torch.bfloat16))
    u = torch.randn(r, r, device=dev)
    res = {}
    for backend in ("triton", "torch"):
        res[backend] = _bench(lambda: ops.lowrank_update(w, u, basis, scale=0.25, step_size=1e-3, lr=1e-3,
                                                         weight_decay=0.1, style="torch", backend=backend),
                              reset=lambda: w.copy_(w0))
    _row(f"fused update W {o}x{i} bf16 r={r} 2-sided", res)
    naive = _bench(lambda: w.sub_(1e-3 * (basis.left @ (u.bfloat16() @ basis.right))), reset=lambda: w.copy_(w0))
    print(f"   {'  naive W -= lr*(P@U@Qt)':38s} torch  {naive[0]:8.3f} ms {naive[1] / MIB:8.1f} MiB")
    g = torch.randn(o, i, device=dev, dtype=torch.bfloat16)
    one = Basis(None, basis.right)
    res = {b: _bench(lambda b=b: ops.project(g, one, backend=b)) for b in ("triton", "torch")}
    _row(f"projection G Q  {o}x{i} bf16 r={r}", res)
    m0, v0, gl = torch.randn(o, r, device=dev), torch.rand(o, r, device=dev), torch.randn(o, r, device=dev)
    m, v = m0.clone(), v0.clone()
    res = {b: _bench(lambda b=b: ops.adam_step(m, v, gl, 5, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, style="torch",
                                                backend=b), reset=lambda: (m.copy_(m0), v.copy_(v0)))
           for b in ("triton", "torch")}
    _row(f"low-rank Adam ({o}x{r}) fp32", res)


def e2e_section(steps: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hmt_core import hmt
    from hmt_core.activations.apply import apply_policy
    from hmt_core.activations.policy import ActivationPolicy

    print(f"== end to end: LLaMA 4x1024 (inter 2752), HMT Mode A r=128, INT8 MLP/attention activations, {steps} steps")
    batch, seq = 8, 1024
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2752, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=seq)
        model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
        apply_policy(model, ActivationPolicy(mlp_intermediate="int8", attn_out="int8", attn_qkv="int8"))
        method = hmt.make(hmt.Config(rank=128, update_interval=1000))
        method.attach(model, max_grad_norm=1.0)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
        with kernels.using(backend):
            for step in range(steps + 2):  # two warm-up steps (compilation, basis refresh)
                if step == 2:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                method.start_micro_batch(0, 1)
                model(input_ids=ids, labels=ids).loss.backward()
                method.step()
                method.zero_grad()
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(f"   {backend:7s} {steps * batch * seq / elapsed:10.0f} tokens/s   peak allocated "
              f"{torch.cuda.max_memory_allocated() / MIB:9.1f} MiB")
        del model, method
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true", help="also measure the fp32 bound on real CPU tensors")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    memory_section(a.real)
    if not torch.cuda.is_available():
        print("== GPU sections: no CUDA GPU on this machine; kernel timings and tokens/s skipped (exit 0)")
        return 0
    if not kernels.triton_available():
        print("== GPU sections: triton is not installed (pip install 'hmt[triton]'); skipped (exit 0)")
        return 0
    ops_section()
    if not a.skip_e2e:
        e2e_section(a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
