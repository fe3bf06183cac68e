"""INT8 weights for HMT (``method.weight_dtype=int8``; Q-GaLore, Zhang et al., 2024): memory at 7B/13B, step time,
loss and quantization error, side by side in one run (CPU; not a test).

    python benchmarks/int8_bench.py                                 # everything (≈ 20-40 min on 2 shared cores)
    python benchmarks/int8_bench.py --sizes 7b --skip-train          # only the 7B dry runs
    python benchmarks/int8_bench.py --skip-dryrun --steps 200        # step time, loss and quantization error

(a) Dry-run peaks (``mode=dryrun``'s trace, seq 2048, batch 1, two steps; GiB at the step's peak, the activation
probe's peak beside it) of HMT with BF16 and INT8 weights, with its defaults and with the memory-minimal setting
of docs/dryrun.md's 7B table, and of ``method=qlora`` / ``method=adamw`` (+ ``method.eight_bit=true``) when those can be
traced (else ``n/a (reason)``). Targets: 7B HMT int8 memory-minimal ≤ 10.0 GiB, 13B ≤ 20.0 GiB.
(b) Step time of the ``tiny`` model (h 256, L 4, vocab 4096, batch 8 × seq 128, HMT defaults, the loop's
``train_step`` with autocast and the fused loss): INT8 vs BF16 weights, interleaved steps, medians, one thread.
Target ≤ 1.3×.
(c) Validation loss after ``--steps`` steps (default 200; the loop's defaults: batch 8 × seq 128, warmup 20,
cosine, clipping 1.0, built-in corpus) of the tiny model, BF16 vs INT8 weights from the same initialization.
Target: within 3%.
(d) Quantization error ‖Ŵ − W‖/‖W‖ (round-to-nearest) of block sizes 32 … 1024 and per-output-channel scales
(one block per row) on a Llama-initialized 4096 × 4096 weight (N(0, 0.02²)), the same with 8 input features 20×
larger (the outlier features of trained LLMs, Dettmers et al. 2022, "LLM.int8()"), and the tiny model's projected
weights after the BF16 run of (c), with the scales' bytes per element: why 256.

Writes ``results/int8_bench/int8_bench.json`` (``--out``). A partial run (``--skip-train``, ``--skip-dryrun``,
``--sizes``, ``--rows``) updates only what it measured in an existing file, e.g. the AdamW rows alone:
``python benchmarks/int8_bench.py --skip-train --rows adamw``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import methods
from experiments.config import ModelConfig, TrainConfig, register_configs, to_run_config
from hmt_core.hmt import projected_weight_names

GIB = 2**30
CONF = str(Path(__file__).resolve().parents[1] / "experiments" / "conf")
MEMORY_MIN = ["method.mode=B", "method.basis=random", "method.scaling=tensor", "method.rank=1", "method.scale=128",
              "method.target_patterns=[attn,mlp,lm_head]", "method.state_dtype=bf16", "method.dense_8bit=true",
              "activation=full_ckpt", "train.max_grad_norm=0"]
ROWS = {  # label -> overrides
    "hmt bf16 (defaults)": ["method=hmt"],
    "hmt int8 (defaults)": ["method=hmt", "method.weight_dtype=int8"],
    "hmt bf16 (memory-minimal)": ["method=hmt", *MEMORY_MIN],
    "hmt int8 (memory-minimal)": ["method=hmt", *MEMORY_MIN, "method.weight_dtype=int8"],
    "qlora": ["method=qlora"],
    "adamw": ["method=adamw"],
    "adamw 8-bit": ["method=adamw", "method.eight_bit=true"],
}
TARGETS_GIB = {"7b": 10.0, "13b": 20.0}  # HMT int8, memory-minimal
CATEGORIES = ("params", "grads", "optimizer", "activations", "temp")


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_run_config(hydra_compose("run", overrides=list(overrides)))


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:160]


# ---------------------------------------------------------------------------------------------- (a) dry runs
def dry_run(size: str, overrides: list[str], seq: int) -> dict:
    from experiments.dryrun import trace_steps

    t0 = time.perf_counter()
    try:
        run = compose("mode=dryrun", f"model={size}", f"train.seq_len={seq}", "train.batch_size=1", *overrides)
        traced = trace_steps(run, methods.make_method(run.method), fake=True)
    except Exception as e:  # noqa: BLE001  (not traceable, an unknown key, a failing third-party op: reported)
        return {"ok": False, "reason": _reason(e), "wall_s": round(time.perf_counter() - t0, 1)}
    rep = traced["report"]
    return {"ok": True, "peak_bytes": rep.peak_bytes, "peak_by_category_bytes": rep.peak_by_category_bytes,
            "peak_by_phase_bytes": rep.peak_by_phase_bytes, "probe_peak_bytes": traced["probe_peak_bytes"],
            "assumed_scalars": traced["assumed_scalars"],
            "int8_weight_bytes": traced["method_summary"].get("int8/weight_bytes"),
            "wall_s": round(time.perf_counter() - t0, 1)}


def print_dry(size: str, rows: dict[str, dict], seq: int) -> None:
    print(f"\n(a) {size} dry run, seq {seq}, batch 1 (GiB at the step's peak)")
    head = f"{'method (settings)':<28} {'peak':>7} " + " ".join(f"{c:>11}" for c in CATEGORIES) + f" {'probe':>7}"
    print(head)
    for label, r in rows.items():
        if not r["ok"]:
            print(f"{label:<28} n/a ({r['reason']})")
            continue
        cats = " ".join(f"{r['peak_by_category_bytes'][c] / GIB:>11.2f}" for c in CATEGORIES)
        probe = f"{r['probe_peak_bytes'] / GIB:>7.2f}" if r["probe_peak_bytes"] else f"{'—':>7}"
        print(f"{label:<28} {r['peak_bytes'] / GIB:>7.2f} {cats} {probe}")


# -------------------------------------------------------------------------------------------- (b) step time
def tiny_setup(weight_dtype: str, vocab: int = 4096):
    from experiments.models import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(), vocab_size=vocab)
    method = methods.make_method(methods.make_config({"name": "hmt", "weight_dtype": weight_dtype}))
    model = method.prepare(model)
    model.train()
    method.attach(model, max_grad_norm=1.0)
    return model, method


def step_times(reps: int, warmup: int) -> dict:
    from experiments.loop import autocast_context, train_step

    cfg = TrainConfig()
    gen = torch.Generator().manual_seed(0)
    setups = {wd: tiny_setup(wd) for wd in ("bf16", "int8")}
    times: dict[str, list[float]] = {wd: [] for wd in setups}
    for r in range(warmup + reps):
        ids = torch.randint(0, 4096, (cfg.batch_size, cfg.seq_len), generator=gen)
        for wd, (model, method) in setups.items():  # interleaved: machine load drifts hit both alike
            t0 = time.perf_counter()
            train_step(model, method, [ids], meter=None, autocast=lambda: autocast_context(torch.device("cpu"), True))
            if r >= warmup:
                times[wd].append(time.perf_counter() - t0)
    med = {wd: statistics.median(v) for wd, v in times.items()}
    return {"median_step_s": med, "steps_s": times, "ratio_int8_over_bf16": med["int8"] / med["bf16"],
            "threads": torch.get_num_threads(), "batch": cfg.batch_size, "seq_len": cfg.seq_len}


# ------------------------------------------------------------------------------------------- (c) loss at N steps
def train_tiny(weight_dtype: str, steps: int) -> tuple[dict, torch.nn.Module]:
    from experiments.data.corpus import build_corpus

    cfg = TrainConfig(steps=steps, progress=False)
    corpus = build_corpus(path=None, text_field="text", val_fraction=0.05, vocab_size=4096, seq_len=cfg.seq_len,
                          batch_size=cfg.batch_size, seed=0, cache_dir="~/.cache/hmt")
    model, method = tiny_setup(weight_dtype, corpus.vocab_size)
    return train_with_val_curve(model, method, corpus, cfg), model


def train_with_val_curve(model, method, corpus, cfg: TrainConfig) -> dict:
    """``run_training`` on the CPU: final losses, the validation curve, median step time and wall time."""
    from experiments.loop import run_training
    from experiments.memory.meter import MemoryMeter

    curve = []

    def log(record: dict) -> None:
        if "loss/val" in record:
            curve.append({"step": record["step"] + 1, "val_loss": record["loss/val"]})

    t0 = time.perf_counter()
    res = run_training(model, method, corpus, cfg, torch.device("cpu"), log=log, meter=MemoryMeter())
    return {"val_loss": res.val_loss, "train_loss": res.train_loss, "val_curve": curve,
            "step_time_median_s": res.step_time_median_s, "wall_s": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------------------- (d) quantization error
def quant_errors(weights: dict[str, list[torch.Tensor]]) -> dict:
    from hmt_core.int8_weights import dequantize, quantize

    out = {}
    for label, ws in weights.items():
        rows = {}
        for block in (32, 64, 128, 256, 1024, "per-channel"):
            num = den = 0.0
            scale_bytes = 0
            for w in ws:
                b = w.shape[1] if block == "per-channel" else block
                q, s = quantize(w, b)
                num += float((dequantize(q, s, b, torch.float32).double() - w.double()).square().sum())
                den += float(w.double().square().sum())
                scale_bytes += s.numel() * 4
            rows[str(block)] = {"rel_err": (num / den) ** 0.5,
                                "scale_bytes_per_element": scale_bytes / sum(w.numel() for w in ws)}
        out[label] = rows
    return out


def print_quant(errors: dict) -> None:
    print("\n(d) quantization error ‖Ŵ − W‖/‖W‖ (round-to-nearest) by block size along the input dim")
    labels = list(errors)
    print(f"{'block':<12} " + " ".join(f"{lab:>28}" for lab in labels) + f" {'scale B/elem':>13}")
    for block in errors[labels[0]]:
        cells = " ".join(f"{errors[lab][block]['rel_err']:>28.5f}" for lab in labels)
        print(f"{block:<12} {cells} {errors[labels[0]][block]['scale_bytes_per_element']:>13.4f}")


def measure_training(a: argparse.Namespace, result: dict, save: Callable[[], None]) -> None:
    """(b) tiny step time, (c) tiny training bf16 vs int8 and the quantization error of trained weights."""
    t = step_times(a.time_reps, warmup=3)
    result["step_time"] = t
    save()
    print(f"\n(b) tiny step time (median of {a.time_reps}, 1 thread): bf16 {t['median_step_s']['bf16']:.3f} s, "
          f"int8 {t['median_step_s']['int8']:.3f} s, ratio {t['ratio_int8_over_bf16']:.2f}x (target <= 1.3x)")
    runs = {}
    for wd in ("bf16", "int8"):
        runs[wd], model = train_tiny(wd, a.steps)
        if wd == "bf16":
            names = projected_weight_names(model, ("attn", "mlp"))
            trained = [p.detach().float() for n, p in model.named_parameters() if n in names]
    gap = abs(runs["int8"]["val_loss"] - runs["bf16"]["val_loss"]) / runs["bf16"]["val_loss"]
    result["train"] = {"steps": a.steps, "runs": runs, "val_loss_rel_gap": gap}
    save()
    print(f"\n(c) tiny, {a.steps} steps: val loss bf16 {runs['bf16']['val_loss']:.4f}, "
          f"int8 {runs['int8']['val_loss']:.4f}, gap {100 * gap:.2f}% (target <= 3%)")
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(4096, 4096, generator=gen) * 0.02
    outliers = init.clone()
    outliers[:, torch.randperm(4096, generator=gen)[:8]] *= 20  # 0.2% of the input features 20x larger
    result["quant_error"] = quant_errors({"N(0,0.02^2) 4096x4096": [init],
                                          "same, 8 outlier inputs x20": [outliers],
                                          f"tiny after {a.steps} bf16 steps": trained})
    save()
    print_quant(result["quant_error"])


def measure_dryrun(a: argparse.Namespace, result: dict, save: Callable[[], None]) -> None:
    """(a) full-size dry-run peaks of every row, checked against TARGETS_GIB."""
    wanted = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in ROWS]
    if unknown:
        raise SystemExit(f"error: --rows: unknown rows {unknown}; choose from {list(ROWS)}")
    kept = result.get("dryrun", {})
    same_shape = (kept.get("seq_len"), kept.get("batch_size")) == (a.seq, 1)
    result["dryrun"] = {"seq_len": a.seq, "batch_size": 1, "sizes": kept.get("sizes", {}) if same_shape else {}}
    for size in [s.strip() for s in a.sizes.split(",") if s.strip()]:
        rows = result["dryrun"]["sizes"].get(size, {})
        for label in wanted:
            rows[label] = dry_run(size, ROWS[label], a.seq)
            result["dryrun"]["sizes"][size] = rows
            save()
            print(f"  traced {size} {label}: "
                  + (f"{rows[label]['peak_bytes'] / GIB:.2f} GiB" if rows[label]["ok"] else "n/a")
                  + f" in {rows[label]['wall_s']} s", flush=True)
        print_dry(size, rows, a.seq)
        target = TARGETS_GIB.get(size)
        best = rows.get("hmt int8 (memory-minimal)")
        if target is not None and best is not None and best["ok"]:
            print(f"  target {size} hmt int8 memory-minimal <= {target} GiB: {best['peak_bytes'] / GIB:.2f} GiB "
                  + ("(met)" if best["peak_bytes"] <= target * GIB else "(MISSED)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="7b,13b")
    ap.add_argument("--rows", default=",".join(ROWS), help="dry-run rows (labels, comma-separated)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--time-reps", type=int, default=9)
    ap.add_argument("--skip-dryrun", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--out", default="results/int8_bench")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = out_dir / "int8_bench.json"  # a partial run keeps what it does not re-measure
    result: dict = json.loads(previous.read_text()) if previous.exists() else {}
    result.update({"schema": "hmt-int8-bench/1", "torch": torch.__version__, "targets_gib": TARGETS_GIB,
                   "step_time_target_ratio": 1.3, "val_loss_target_rel_gap": 0.03})

    def save() -> None:
        tmp = out_dir / "int8_bench.json.tmp"
        tmp.write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
        tmp.replace(out_dir / "int8_bench.json")

    if not a.skip_train:
        measure_training(a, result, save)
    if not a.skip_dryrun:
        measure_dryrun(a, result, save)
    save()
    print(f"\nwrote {out_dir / 'int8_bench.json'}")


if __name__ == "__main__":
    main()
