"""How large is the LM head's first update, per optimizer setting, as a function of vocabulary and width?

A proxy of a model card (its config.json with ``--layers`` decoder layers: full width and vocabulary, Llama's init,
fp32) on the built-in corpus (a BPE trained at the card's vocabulary; ``--tokens`` a step), one update of each
setting from the same state at the same step size (the first warm-up step of a plan: lr 1e-2 / 20), and the loss on
the next step's batch before and after (where a training run sees it). Printed and written per (card, setting):
the loss change, the head update's norm, its norm over the rows of the batch's target tokens and its largest row's norm, each next to AdamW's.

    python -m benchmarks.head_update_size [--cards tiny,llama3.1-8b] [--layers 1] [--tokens 512]
                                          [--out results/head_update/head_update_size.json]

Why a projected head at rank 1 with a tensor scale moves the loss (docs/head_update.md): the update is
``√α · s · G`` with ``s = ‖N‖/‖R‖`` and ``R = G q`` (V × 1); Adam's first direction is ``N = sign(R)``, so
``‖N‖ = √V`` whatever the batch, while ``‖R‖ ≈ ‖G‖`` is carried by the few hundred rows of the tokens the batch
contains. The whole update norm ``√α·√V`` lands on those rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from experiments import methods
from experiments.data.corpus import build_corpus
from experiments.results import atomic_write_text

REPO = Path(__file__).resolve().parent.parent
CARDS = REPO / "experiments" / "model_cards"
LR = 1e-2 / 20  # the 8B plan's first warm-up step (lr 1e-2, 20 warm-up steps)
MINI = {"mode": "B", "basis": "random", "scaling": "tensor", "rank": 1, "scale": 128.0}
SETTINGS: dict[str, dict] = {
    "adamw": {"name": "adamw"},
    "mini-head-projected": {"name": "hmt", **MINI, "target_patterns": ["attn", "mlp", "lm_head"]},
    "mini-head-dense": {"name": "hmt", **MINI, "target_patterns": ["attn", "mlp"]},
    "modeA-head-projected": {"name": "hmt", "mode": "A", "target_patterns": ["attn", "mlp", "lm_head"]},
}
TINY = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 688, "vocab_size": 4096, "tie_word_embeddings": False}


def proxy_model(card: str, layers: int, dtype: torch.dtype = torch.float32):
    """The card's config with ``layers`` decoder layers, in ``dtype``, random init (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if card == "tiny":
        config = AutoConfig.for_model(**TINY)
    else:
        config = AutoConfig.from_pretrained(CARDS / card, local_files_only=True)
    config.num_hidden_layers = layers
    if hasattr(config, "layer_types") and config.layer_types:
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def batches_of(vocab: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two training batches (the update's, and the next step's: where a run sees the jump)."""
    seq = 256
    corpus = build_corpus(path=None, text_field="text", val_fraction=0.05, vocab_size=vocab, seq_len=seq,
                          batch_size=tokens // seq, seed=0, cache_dir="~/.cache/hmt")
    return corpus.train.batch(0), corpus.train.batch(1)


def one_update(card: str, layers: int, batches: tuple[torch.Tensor, torch.Tensor], setting: dict, *,
               head_only: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Loss on the next batch before and after one update of ``setting`` (lr ``LR``) on the first, and the head
    update's norms. ``head_only``: every other weight frozen (the head's update alone moves the loss)."""
    batch, following = batches
    model = proxy_model(card, layers, dtype)
    if head_only:
        head_weight = model.get_output_embeddings().weight
        for p in model.parameters():
            p.requires_grad_(p is head_weight)
    method = methods.make_method(methods.make_config({**setting, "lr": LR}))
    model = method.prepare(model) or model
    method.attach(model, max_grad_norm=None)
    head = model.get_output_embeddings().weight
    # an INT8 head keeps its values in codes, not in this weight: losses only
    before = None if setting.get("embedding_dtype") == "int8" else head.detach().clone()
    with torch.no_grad():
        next_before = model(following, labels=following).loss
    loss = model(batch, labels=batch).loss
    method.start_micro_batch(0, 1)
    loss.backward()
    method.step()
    method.zero_grad()
    with torch.no_grad():
        after = model(following, labels=following).loss
    out = {"loss_before": next_before.item(), "loss_after": after.item(), "loss_change": (after - next_before).item(),
           "width": model.config.hidden_size, "vocab": model.config.vocab_size}
    if before is None:
        return out
    row_norms = (head.detach().float() - before.float()).norm(dim=1)  # (V,)
    rows = torch.unique(batch[:, 1:])
    return {**out, "head_update_norm": row_norms.norm().item(), "target_rows": int(rows.numel()),
            "target_rows_update_norm": row_norms[rows].norm().item(), "max_row_update_norm": row_norms.max().item()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cards", default="tiny,llama3.1-8b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--head-only", action="store_true", help="train lm_head alone (the rest frozen)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--out", default=str(REPO / "results" / "head_update" / "head_update_size.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for card in args.cards.split(","):
        batches = batches_of(proxy_model(card, 0).config.vocab_size, args.tokens)
        for name in args.settings.split(","):
            setting = SETTINGS[name]
            if args.head_only and setting["name"] == "hmt":  # the head is the one weight: projected or not run
                if "lm_head" not in setting["target_patterns"]:
                    continue  # a dense head alone is AdamW's row
                setting = {**setting, "target_patterns": ["lm_head"]}
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
            t1 = time.perf_counter()
            row = {"card": card, "layers": args.layers, "setting": name, "lr": LR, "head_only": args.head_only,
                   "dtype": args.dtype, **one_update(card, args.layers, batches, setting, head_only=args.head_only,
                                                     dtype=dtype),
                   "wall_s": round(time.perf_counter() - t1, 1)}
            rows.append(row)
            norms = (f"  head ‖Δ‖ {row['head_update_norm']:.3f}  target rows {row['target_rows_update_norm']:.3f}  "
                     f"max row {row['max_row_update_norm']:.4f}") if "head_update_norm" in row else ""
            print(f"{card:12s} d={row['width']:5d} V={row['vocab']:6d} {name:22s} loss {row['loss_before']:.3f} -> "
                  f"{row['loss_after']:.3f} ({row['loss_change']:+.3f}){norms}",
                  flush=True)
    old = json.loads(Path(args.out).read_text())["rows"] if Path(args.out).exists() else []
    ident = lambda r: (r["card"], r["layers"], r["setting"], r.get("head_only", False), r.get("dtype", "fp32"))
    rows = [r for r in old if ident(r) not in {ident(x) for x in rows}] + rows
    out = {"tokens_per_step": args.tokens, "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(args.out), json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({out['wall_s']} s)")


if __name__ == "__main__":
    main()
