"""The learning rate and warm-up a plan writes, from the optimizer setting and the model's width (published recipes).

- Mode A (GaLore-style low-rank AdamW): GaLore's pretraining scripts (Zhao et al., 2024; the GaLore repository's
  ``scripts/benchmark_c4/llama_{60m,130m,350m,1b}.sh``: lr 0.01 at hidden sizes up to 2,048; ``llama_7b.sh`` and
  the single-GPU 7B scripts: lr 0.005 at hidden 4,096, gradient clipping 1.0) warm up over 10 % of 150k steps. On a
  CPU proxy of Mistral-7B (width 4,096, ``benchmarks.plan_learns``) the 16 GiB plan at 0.005 after a one-step
  warm-up went 11.16 → 9.63 → 11.49 (a step 0.33 nats above step 0; ``results/plan_learns/
  archive-mistral-modeA-lr5e-3-warmup1.json``), so Mode A's rate falls with the width as Mode B's does (below):
  ``0.01 · min(1, 256/width)``, anchored at HMT default's tuned 0.01 on ``tiny`` — itself Mode A at width 256.
- Mode B (APOLLO-Mini: rank 1, tensor scale, α = 128): APOLLO's pretraining scripts (Zhu et al., 2024; the APOLLO
  repository's ``scripts/pretrain_c4/llama_{60m,1b,7b}_apollo_mini.sh`` and the 13B one) use lr 0.01 at every size
  with a warm-up of 10 % of 100k–150k steps; the embedding and LM head stay in AdamW (the planner never projects
  the head under Mode B: ``experiments.planner.space.learns_at_scale``). A plan's run is hundreds of steps, and on a
  CPU proxy of Llama-3.1-8B (width 4,096, ``benchmarks.plan_learns``) the 16 GiB plan at 0.01 after a one-step
  warm-up went 12.56 → 24.73 at step 1. So the rate falls with the width as μP prescribes for Adam's hidden and
  output matrices (Yang et al., 2022, "Tensor Programs V", Table 3: ∝ 1/fan_in), anchored at 0.01 for width 256
  (HMT default's rate, its tuned winner in the campaign on ``tiny``): ``0.01 · min(1, 256/width)``, 6.25e-4 at 4,096.
- A tied table (the input embedding is the LM head) keeps the rate of width 256 at every width,
  ``method.embedding_lr_scale = max(1, width/256)``, as μP keeps an input layer's Adam rate constant in the width
  (Tensor Programs V, Table 3). Measured need (docs/planner.md, "Gemma 2"): on the CPU proxy of Gemma-2-9B (width
  3,584, 256k-row tied table scaled by √width at the input) the random-init model copies its input token at the
  softcap's logit (loss 27.1 against ln V = 12.45); Adam moves each table entry by about the rate a step, so the
  table (entries ~0.02) leaves that state in ~0.02/rate steps: 27.11 → 24.88 in 10 steps with the whole model at
  0.01·256/3584, 27.11 → 14.68 with the table at 0.01. An untied table keeps the matrices' rate: at 0.01 the
  Llama-3.1-8B answer's loss jumped 2.06 nats above step 0 at step 2 (``results/plan_learns/
  archive-llama3-embedding-lr1e-2-partial.json``), while every untied family passes with it at 1/width.
- Fine-tuning (``model.path`` with weights): the recipes above are for pretraining from random init and would move a
  trained model far off its minimum. The campaign's fine-tuning regime (``experiments/sweeps/campaign_finetune.yaml``:
  a trained ``tiny`` continued on new text, 100 steps, warm-up 10 %, each row tuned over five rates) chose 1e-3 for
  HMT and GaLore (docs/campaign/tables/main.md, 10× below their pretraining winners); scaled with the width as
  Mode B's rate is: ``1e-3 · min(1, 256/width)``, warm-up 10 % of the steps, both modes.

A key the user set on the planner's command line (``method.lr=…``, ``train.warmup_steps=…``) is kept as given.
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.models import has_weights, load_hf_config

WARMUP_FRACTION = 0.1  # both recipes: 10 % of the steps (1k/10k at 60M, 10k/100k at 1B, 15k/150k at 7B)
MUP_BASE_WIDTH = 256  # both modes' rate is 0.01 at this width and falls as 1/width above it (module docstring)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    lr: float
    embedding_lr_scale: float  # the input embedding's rate = lr × this
    warmup_steps: int
    source: str


def recipe_for(*, mode: str, width: int, steps: int, fine_tuning: bool, tied: bool = False) -> Recipe:
    """The plan's rate and warm-up (module docstring); ``tied``: the input embedding is the LM head."""
    warmup = max(1, round(WARMUP_FRACTION * steps))
    ratio = min(1.0, MUP_BASE_WIDTH / width)
    table = 1 / ratio if tied else 1.0
    embedding = (f", the tied embedding at {table:g}x that (muP: an input layer's rate does not fall with the width)"
                 if table != 1 else "")
    if fine_tuning:
        return Recipe(lr=1e-3 * ratio, embedding_lr_scale=table, warmup_steps=warmup,
                      source=f"fine-tuning a loaded model: the campaign's tuned fine-tuning rate 1e-3 at width 256 "
                             f"scaled to hidden size {width}: 1e-3 x min(1, 256/{width}){embedding}; warm-up 10% "
                             "of the steps")
    published = "APOLLO-Mini's lr 0.01" if mode == "B" else "HMT default's tuned lr 0.01 at width 256 (Mode A)"
    return Recipe(lr=1e-2 * ratio, embedding_lr_scale=table, warmup_steps=warmup,
                  source=f"{published} scaled by muP to hidden size {width}: 0.01 x min(1, 256/{width})"
                         f"{embedding}; warm-up 10% of the steps")


def run_recipe(run, choice) -> Recipe:
    """The rate and warm-up a plan of ``run`` with the optimizer setting ``choice`` writes (its mode, the model's
    width, pretraining or fine-tuning a loaded model)."""
    hf = run.model.hf_dir
    config = load_hf_config(hf) if hf else None
    width = config.hidden_size if config is not None else run.model.hidden_size
    tied = bool(config.tie_word_embeddings) if config is not None else run.model.tie_embeddings
    fine = bool(run.model.path) and has_weights(run.model.path)
    return recipe_for(mode=choice.mode, width=width, steps=run.train.steps, fine_tuning=fine, tied=tied)


def written_rates(run, choice, overrides) -> tuple[float, float]:
    """(method.lr, method.embedding_lr_scale) a plan writes: the recipe's, unless the planner's command line set the
    rate (then the run's own scale, unless that was set too)."""
    rec = run_recipe(run, choice)
    lr = run.method.lr if user_set(overrides, "method.lr") else rec.lr
    mine = user_set(overrides, "method.lr") or user_set(overrides, "method.embedding_lr_scale")
    return lr, (run.method.embedding_lr_scale if mine else rec.embedding_lr_scale)


def user_set(overrides: list[str] | tuple[str, ...], key: str) -> bool:
    """Whether ``key`` was given on the planner's command line (``key=value``, ``+key=``, ``++key=``)."""
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)
