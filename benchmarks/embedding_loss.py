"""Loss cost of the INT8 embedding and LM head (``method.embedding_dtype=int8``): the default tiny model trained on
the local corpus from the same seed, same batches, in the memory-minimal HMT setting (``benchmarks.embedding_memory``'s
``BASE``: Mode B rank 1 with lm_head, BF16 state, 8-bit dense moments, INT8 projected weights, no clipping) with
the BF16 and with the INT8 embedding and head.

    python -m benchmarks.embedding_loss [--steps 200] [--settings bf16,int8,int8-lazy,...]
                                        [--out results/embedding_memory/loss_tiny.json]

Writes the validation curve, the final train/val losses of each run and how long it took; prints them. Runs of
settings not asked for this time are kept from the existing file (each run records the commit it ran at).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.int8_bench import train_with_val_curve
from experiments import methods
from experiments.config import ModelConfig, TrainConfig
from hmt_core.activations import apply_policy
from hmt_core.activations.policy import PRESETS, ActivationPolicy

REPO = Path(__file__).resolve().parent.parent
# the method keys of benchmarks.embedding_memory.BASE (activation checkpointing changes no number here)
MINIMAL = {"name": "hmt", "mode": "B", "basis": "random", "scaling": "tensor", "rank": 1, "scale": 128,
           "target_patterns": ["attn", "mlp", "lm_head"], "state_dtype": "bf16", "dense_8bit": True,
           "weight_dtype": "int8"}
LAZY = {"embedding_dtype": "int8", "embedding_update": "lazy_exact"}
# key -> (label, method overrides, activation policy: None = autograd's own saving); the labels are the JSON's run
# names. Full checkpointing alone changes no number (tests/test_activation_policy.py), INT8 layer inputs do.
SETTINGS: dict[str, tuple[str, dict, ActivationPolicy | None]] = {
    "bf16": ("bf16 embedding and head", {}, None),
    "int8": ("int8 embedding and head", {"embedding_dtype": "int8"}, None),
    "int8-lazy": ("int8, embedding rows lazy_exact (8-bit row moments)", LAZY, None),
    "int8-sparse": ("int8, embedding rows sparse_adam (8-bit row moments)",
                    {"embedding_dtype": "int8", "embedding_update": "sparse_adam"}, None),
    "int8-lazy-ckpt": ("int8, lazy_exact rows, full checkpointing", LAZY, PRESETS["full_ckpt"]),
    "int8-lazy-ckpt8": ("int8, lazy_exact rows, full checkpointing with INT8 layer inputs", LAZY,
                        PRESETS["full_ckpt"].replace(residual="int8")),
    "int8-lazy-ckpt4": ("int8, lazy_exact rows, full checkpointing with outlier-aware INT4 layer inputs", LAZY,
                        PRESETS["full_ckpt"].replace(residual="int4_outlier")),
}


def train(extra: dict, steps: int, policy: ActivationPolicy | None = None) -> dict:
    from experiments.data.corpus import build_corpus
    from experiments.models import build_model

    cfg = TrainConfig(steps=steps, progress=False, max_grad_norm=0.0)
    corpus = build_corpus(path=None, text_field="text", val_fraction=0.05, vocab_size=4096, seq_len=cfg.seq_len,
                          batch_size=cfg.batch_size, seed=0, cache_dir="~/.cache/hmt")
    torch.manual_seed(0)
    model = build_model(ModelConfig(), vocab_size=corpus.vocab_size)
    method = methods.make_method(methods.make_config({**MINIMAL, **extra}))
    model = method.prepare(model)
    model.train()
    method.attach(model, max_grad_norm=None)
    if policy is not None:
        apply_policy(model, policy)
    return train_with_val_curve(model, method, corpus, cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", type=Path, default=REPO / "results" / "embedding_memory" / "loss_tiny.json")
    args = parser.parse_args(argv)
    keys = args.settings.split(",")
    if any(k not in SETTINGS for k in keys):
        parser.error(f"unknown setting in {args.settings!r}; known: {', '.join(SETTINGS)}")
    start = time.perf_counter()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    runs = json.loads(args.out.read_text())["runs"] if args.out.exists() else {}
    for key in keys:
        label, extra, policy = SETTINGS[key]
        runs[label] = {**train(extra, args.steps, policy), "commit": commit}
    out = {"steps": args.steps, "model": "tiny (ModelConfig defaults)", "method": MINIMAL, "seed": 0,
           "threads": torch.get_num_threads(), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for label, r in runs.items():
        print(f"{label:<26} train {r['train_loss']:.4f}  val {r['val_loss']:.4f}  ({r['wall_s']} s)")
    print(f"took {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
