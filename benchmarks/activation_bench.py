"""Activation policies side by side in one run: none, full_ckpt, selective, hmt.

For each preset, on the same model, init and batch (built-in corpus, seq len >= 512):
  * act@fwd_end: live bytes of forward-born tensors when forward ends (experiments.memory.meter.MemoryMeter,
    category "activations"): what the step holds for backward, measured by a dispatch-mode tracker;
  * saved(hooks): bytes autograd keeps, measured by the policy's pack hooks (hmt_core.activations.measure);
  * peak-params: step peak of live bytes minus parameters (activations + grads + recompute/decompress temps);
  * step time: median over interleaved rounds of forward+backward (no meter, no optimizer), and ratios to
    full_ckpt.
Then none vs hmt train for the same number of AdamW steps from the same init and batches; validation loss on
fixed held-out batches. Targets: hmt act <= selective act, hmt time <= 0.8 x full_ckpt time.

    python benchmarks/activation_bench.py --seq-len 512 --train-steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from experiments.data.corpus import build_corpus  # noqa: E402
from experiments.memory.meter import MemoryMeter  # noqa: E402
from hmt_core.activations.apply import apply_policy  # noqa: E402
from hmt_core.activations.measure import cosine, flat_grad  # noqa: E402
from hmt_core.activations.policy import PRESETS  # noqa: E402

NAMES = ("none", "full_ckpt", "selective", "hmt")


def make_model(args, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=max(2048, args.seq_len), attn_implementation=args.attn)
    model = LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
    model.train()
    return model


def fwd_bwd(model, ids) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def metered_step(model, ids) -> dict[str, int]:
    meter = MemoryMeter()
    meter.track(model.parameters(), "params")
    meter.track(model.buffers(), "other")
    meter.track([ids], "other")
    with meter:
        with meter.phase("forward"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        at_fwd_end = meter.report().current_by_category_bytes["activations"]
        with meter.phase("backward"):
            loss.backward()
    rep = meter.report()
    return {"act_fwd_end": at_fwd_end, "peak_minus_params": rep.peak_bytes - rep.peak_by_category_bytes["params"]}


def memory_and_time(args, model, ids) -> dict[str, dict]:
    out = {n: {} for n in NAMES}
    grads = {}
    for name in NAMES:
        model.zero_grad(set_to_none=True)
        handle = apply_policy(model, PRESETS[name])
        fwd_bwd(model, ids)  # warm-up, and the hook-measured saved bytes
        out[name]["components"] = handle.saved_bytes()
        out[name]["saved_hooks"] = sum(out[name]["components"].values())
        grads[name] = flat_grad(model)
        model.zero_grad(set_to_none=True)
        out[name].update(metered_step(model, ids))
        model.zero_grad(set_to_none=True)
        handle.remove()
    for name in NAMES:
        out[name]["grad_cos"] = cosine(grads[name], grads["none"])
    times = {n: [] for n in NAMES}
    for _ in range(args.time_rounds):  # interleaved so that load from other processes hits all presets alike
        for name in NAMES:
            handle = apply_policy(model, PRESETS[name])
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fwd_bwd(model, ids)
            times[name].append(time.perf_counter() - t0)
            handle.remove()
    for name in NAMES:
        out[name]["step_s"] = statistics.median(times[name])
    model.zero_grad(set_to_none=True)
    return out


def train_and_validate(args, corpus, name: str) -> tuple[float, float]:
    model = make_model(args, corpus.vocab_size)
    handle = apply_policy(model, PRESETS[name])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    for step in range(args.train_steps):
        loss = fwd_bwd(model, corpus.train.batch(step))
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        val = [float(model(input_ids=b, labels=b, use_cache=False).loss)
               for b in corpus.val.fixed_batches(args.val_batches)]
    handle.remove()
    return float(loss), sum(val) / len(val)


def print_comparison(res: dict) -> None:
    """Each preset's activation bytes, step time and gradient cosine against full_ckpt, per component, and the
    targets (HMT's activations at most selective's, its step at most 0.8× full_ckpt's)."""
    ref = res["full_ckpt"]
    mib = 2.0**20
    print(f"\n{'preset':<10} {'act@fwd_end':>12} {'saved(hooks)':>13} {'peak-params':>12} {'step':>8} "
          f"{'act/fc':>7} {'time/fc':>8} {'grad_cos':>9}")
    for name in NAMES:
        r = res[name]
        print(f"{name:<10} {r['act_fwd_end'] / mib:>9.2f}MiB {r['saved_hooks'] / mib:>10.2f}MiB "
              f"{r['peak_minus_params'] / mib:>9.2f}MiB {r['step_s']:>7.3f}s "
              f"{r['act_fwd_end'] / ref['act_fwd_end']:>7.3f} "
              f"{r['step_s'] / ref['step_s']:>8.3f} {r['grad_cos']:>9.6f}")
    comps = sorted({c for n in NAMES for c in res[n]["components"]})
    print("\nsaved for backward per component (MiB, pack hooks; 'other' = logits/loss outside the model's layers)")
    print(f"{'preset':<10} " + " ".join(f"{c[:12]:>12}" for c in comps))
    for name in NAMES:
        print(f"{name:<10} " + " ".join(f"{res[name]['components'].get(c, 0) / mib:>12.2f}" for c in comps))
    hmt, sel = res["hmt"], res["selective"]
    mem_ok = hmt["act_fwd_end"] <= sel["act_fwd_end"]
    time_ok = hmt["step_s"] <= 0.8 * ref["step_s"]
    print(f"\ntarget hmt act <= selective act: {'HIT' if mem_ok else 'MISS'} "
          f"({hmt['act_fwd_end'] / mib:.2f} vs {sel['act_fwd_end'] / mib:.2f} MiB)")
    print(f"target hmt time <= 0.8 x full_ckpt: {'HIT' if time_ok else 'MISS'} "
          f"({hmt['step_s'] / ref['step_s']:.3f} x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--vocab", type=int, default=512)  # small head: layers dominate the step
    p.add_argument("--time-rounds", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (0: leave as is). 1 by default: on a shared 2-core box two OpenMP "
                        "threads made elementwise ops ~10x slower, which distorts compress-vs-recompute timings")
    p.add_argument("--cache-dir", default="~/.cache/hmt")
    args = p.parse_args()
    if args.seq_len < 512:
        print("note: the activation targets are stated for seq len >= 512")
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = build_corpus(path=None, text_field="text", val_fraction=0.05, vocab_size=args.vocab, seq_len=args.seq_len,
                          batch_size=args.batch, seed=args.seed, cache_dir=args.cache_dir)
    print(f"model: Llama h={args.hidden} ffn={args.ffn} layers={args.layers} heads={args.heads} vocab="
          f"{corpus.vocab_size} attn={args.attn} dtype={args.dtype}; batch {args.batch} x seq {args.seq_len}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    model = make_model(args, corpus.vocab_size)
    ids = corpus.train.batch(0)
    res = memory_and_time(args, model, ids)
    print_comparison(res)
    if args.train_steps > 0:
        print(f"\ntraining {args.train_steps} AdamW steps (lr {args.lr}) from the same init and batches; val loss on "
              f"{args.val_batches} fixed held-out batches")
        for name in ("none", "hmt"):
            t0 = time.perf_counter()
            train_loss, val_loss = train_and_validate(args, corpus, name)
            print(f"{name:<5} train loss {train_loss:.4f}  val loss {val_loss:.4f}  ({time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
