"""Update precision at a fine-tuning learning rate (one CPU run; not a test): how much of each update BF16 weights
keep under plain round-to-nearest writes, fp32 master weights and stochastic rounding (``hmt_core.precision``).

    python benchmarks/precision_bench.py [--hidden 256 --layers 4 --vocab 4096 --seq 128 --batch 8
                                          --pretrain-steps 100 --steps 20 --lr 1e-5]

A tiny Llama (the ``tiny`` model: h 256, L 4, vocab 4096) is pretrained in fp32 (torch AdamW, lr 1e-3) on a
synthetic bigram language, cast to BF16 and fine-tuned for ``--steps`` steps at ``--lr`` (constant, clipping 1.0)
on another bigram language, by ``adamw`` and ``hmt`` (its defaults: Mode A, rSVD, dynamic rank, per-layer
updates) in three modes each — plain BF16, ``master_weights=true``, ``stochastic_rounding=true`` — from the same
start on the same batches. Columns (all trainable weights together):

- ``changed/step``: fraction of weight elements whose BF16 value changed in a step (mean over steps);
- ``‖ΔW‖/‖ΔW*‖ step``: the BF16 weights' actual change over the fp32 update the optimizer computed, ΔW* (mean over
  steps);
- ``cum ‖ΔW‖/‖ΣΔW*‖`` and ``cum ⟨ΔW,ΣΔW*⟩/‖ΣΔW*‖²``: over the whole run, W_T − W_0 against the sum of the
  intended updates: the norm ratio, and the fraction of the intended drift realized (its projection; stochastic
  rounding's zero-mean noise counts in the first, not in the second);
- ``Δ eval loss``: change of the held-out loss on the fine-tuning language; ``state MiB``: optimizer state.

ΔW* comes from the ``UpdateWriter`` probe (every write of a method using it; a plain BF16 write is then made from
an fp32 temporary rounded to nearest, bit-identical to the in-place write without weight decay, as
tests/test_precision.py checks) and, for torch.optim.AdamW's plain BF16 step (which does not use it), from its
state after the step: −lr/(1−β₁ᵗ)·m/denom in fp32 with denom from torch's own BF16 ops, the value addcdiv rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baselines import adamw  # noqa: E402
from benchmarks.optimizer_bench import bigram_data  # noqa: E402
from hmt_core import hmt  # noqa: E402

MODES = {"bf16": {}, "master fp32": {"master_weights": True}, "stochastic rounding": {"stochastic_rounding": True}}


def build_model(a, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.heads, max_position_embeddings=a.seq)
    return LlamaForCausalLM(cfg).float()


def pretrain(a) -> dict[str, torch.Tensor]:
    model = build_model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in bigram_data(a.vocab, a.pretrain_steps, a.batch, a.seq, seed=1):
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        x = bigram_data(a.vocab, 1, a.batch, a.seq, seed=1)[0]
        print(f"pretrained {a.pretrain_steps} steps: loss {float(model(input_ids=x, labels=x).loss):.3f}")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_method(name: str, mode: str, lr: float):
    if name == "adamw":
        return adamw.make(adamw.Config(lr=lr, **MODES[mode]))
    return hmt.make(hmt.Config(lr=lr, **MODES[mode]))


def writer_of(method):
    if isinstance(method, hmt.HMTMethod):
        return method.opt.writer
    return getattr(method.driver.optimizer, "writer", None)


@torch.no_grad()
def torch_adamw_intended(opt: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """data_ptr -> the fp32 update torch.optim.AdamW's last step computed (weight decay 0): step·m/denom with
    denom = (√v / √(1−β₂ᵗ)) + ε in the state's dtype, as torch's single-tensor AdamW forms it."""
    out = {}
    for group in opt.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            t = float(st["step"])
            denom = (st["exp_avg_sq"].sqrt() / (1 - beta2 ** t) ** 0.5).add_(group["eps"])
            out[p.data_ptr()] = (-group["lr"] / (1 - beta1 ** t)) * st["exp_avg"].float() / denom.float()
    return out


@torch.no_grad()
def eval_loss(model, evals: list[torch.Tensor]) -> float:
    return statistics.mean(float(model(input_ids=x, labels=x).loss) for x in evals)


def finetune(a, base: dict[str, torch.Tensor], name: str, mode: str, data, evals) -> dict[str, float]:
    model = build_model(a)
    model.load_state_dict(base)
    model = model.to(torch.bfloat16)
    method = make_method(name, mode, a.lr)
    method.attach(model, max_grad_norm=1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    index_of = {p.data_ptr(): i for i, p in enumerate(params)}
    w0 = [p.detach().float().clone() for p in params]
    step_intended = [torch.zeros_like(w) for w in w0]
    total_intended = [torch.zeros_like(w) for w in w0]
    writer = writer_of(method)
    if writer is not None:
        def probe(param, index, delta):
            step_intended[index_of[param.data_ptr()]][index] += delta

        writer.probe = probe
    loss0 = eval_loss(model, evals)
    changed, ratios, t0 = [], [], time.perf_counter()
    numel = sum(w.numel() for w in w0)
    for x in data:
        before = [p.detach().float().clone() for p in params]
        for t in step_intended:
            t.zero_()
        method.start_micro_batch(0, 1)
        model(input_ids=x, labels=x).loss.backward()
        method.step()
        method.zero_grad()
        if writer is None:
            computed = torch_adamw_intended(method.driver.optimizer)
            for p, t in zip(params, step_intended):
                t.copy_(computed[p.data_ptr()])
        actual = [p.detach().float() - b for p, b in zip(params, before)]
        changed.append(sum(int((d != 0).sum()) for d in actual) / numel)
        ratios.append(norm(actual) / norm(step_intended))
        for acc, t in zip(total_intended, step_intended):
            acc.add_(t)
    drift = [p.detach().float() - w for p, w in zip(params, w0)]
    total = norm(total_intended) ** 2
    return {
        "changed/step": statistics.mean(changed),
        "ratio/step": statistics.mean(ratios),
        "cum ratio": norm(drift) / total ** 0.5,
        "cum projection": sum(float((d * t).sum()) for d, t in zip(drift, total_intended)) / total,
        "d eval loss": eval_loss(model, evals) - loss0,
        "state MiB": sum(t.numel() * t.element_size() for t in method.state_tensors()) / 2**20,
        "seconds": time.perf_counter() - t0,
    }


def norm(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().square().sum()) for t in tensors) ** 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pretrain-steps", type=int, default=100)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--methods", default="adamw,hmt")
    a = p.parse_args()
    torch.manual_seed(0)
    base = pretrain(a)
    data = bigram_data(a.vocab, a.steps, a.batch, a.seq, seed=2)
    evals = bigram_data(a.vocab, 2, a.batch, a.seq, seed=3)
    print(f"fine-tuning {a.steps} steps at lr {a.lr:g} (BF16 weights, clipping 1.0), h={a.hidden} L={a.layers} "
          f"vocab={a.vocab}, batch {a.batch} × {a.seq} tokens\n")
    head = ("method", "mode", "changed/step", "‖ΔW‖/‖ΔW*‖ step", "cum ‖ΔW‖/‖ΣΔW*‖", "cum ⟨ΔW,ΣΔW*⟩/‖ΣΔW*‖²",
            "Δ eval loss", "state MiB")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join([":---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
    for name in a.methods.split(","):
        for mode in MODES:
            r = finetune(a, base, name, mode, data, evals)
            print(f"| {name} | {mode} | {r['changed/step']:.3f} | {r['ratio/step']:.3f} | {r['cum ratio']:.3f} | "
                  f"{r['cum projection']:.3f} | {r['d eval loss']:+.4f} | {r['state MiB']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
