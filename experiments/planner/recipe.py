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
- A soft-capped model (Gemma 2: ``final_logit_softcapping`` in its config, with post-sublayer norms) keeps width
  256's rate for every parameter when pretraining: 0.01. Measured on the CPU proxy of Gemma-2-9B
  (``benchmarks.plan_learns``, docs/planner.md "Gemma 2"): HMT default at 0.01 never rose above its step-0 loss
  there, while on the Llama-3.1-8B, Qwen2.5-7B, Mistral-7B and Llama-2-7B proxies it did by 1.5–19 nats; the 24 GiB
  answer at μP's rate (7.1e-4, the table and the norms at 0.01) ended 0.70 nats behind HMT default, and HMT default
  itself at those rates landed where that answer did (13.23 vs 13.16 at step 8): the gap is the rate, not the
  answer's settings. Both models cap their logits (``final_logit_softcapping``, ``attn_logit_softcapping``) and norm
  each sublayer's output before the residual add, which the Gemma 2 report introduced for stable training (Gemma
  Team, 2024, §2). Checked on a one-layer proxy for ten steps: stability at 42 layers is not.
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

# the method keys a plan's rate is made of (``written_rates``); they change no byte a trace measures
RATE_KEYS = ("lr", "embedding_lr_scale", "vector_lr_scale")
WARMUP_FRACTION = 0.1  # both recipes: 10 % of the steps (1k/10k at 60M, 10k/100k at 1B, 15k/150k at 7B)
MUP_BASE_WIDTH = 256  # both modes' rate is 0.01 at this width and falls as 1/width above it (module docstring)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    lr: float
    embedding_lr_scale: float  # the input embedding's rate = lr × this
    vector_lr_scale: float = 1.0  # the norm gains' and biases' rate = lr × this (μP's; the recipe leaves it at 1)
    warmup_steps: int
    source: str


def recipe_for(*, mode: str, width: int, steps: int, fine_tuning: bool, tied: bool = False,
               softcapped: bool = False) -> Recipe:
    """The plan's rate and warm-up (module docstring); ``tied``: the input embedding is the LM head; ``softcapped``:
    the model caps its logits (Gemma 2)."""
    warmup = max(1, round(WARMUP_FRACTION * steps))
    ratio = 1.0 if softcapped and not fine_tuning else min(1.0, MUP_BASE_WIDTH / width)
    table = 1 / ratio if tied else 1.0
    embedding = (f", the tied embedding at {table:g}x that (muP: an input layer's rate does not fall with the width)"
                 if table != 1 else "")
    if fine_tuning:
        return Recipe(lr=1e-3 * ratio, embedding_lr_scale=table, warmup_steps=warmup,
                      source=f"fine-tuning a loaded model: the campaign's tuned fine-tuning rate 1e-3 at width 256 "
                             f"scaled to hidden size {width}: 1e-3 x min(1, 256/{width}){embedding}; warm-up 10% "
                             "of the steps")
    published = "APOLLO-Mini's lr 0.01" if mode == "B" else "HMT default's tuned lr 0.01 at width 256 (Mode A)"
    scaled = (f"kept at every width for a soft-capped model (measured on the Gemma-2-9B proxy, "
              f"experiments/planner/recipe.py)" if softcapped
              else f"scaled by muP to hidden size {width}: 0.01 x min(1, 256/{width})")
    return Recipe(lr=1e-2 * ratio, embedding_lr_scale=table, warmup_steps=warmup,
                  source=f"{published} {scaled}{embedding}; warm-up 10% of the steps")


def run_recipe(run, choice) -> Recipe:
    """The rate and warm-up a plan of ``run`` with the optimizer setting ``choice`` writes (its mode, the model's
    width, pretraining or fine-tuning a loaded model)."""
    hf = run.model.hf_dir
    config = load_hf_config(hf) if hf else None
    width = config.hidden_size if config is not None else run.model.hidden_size
    tied = bool(config.tie_word_embeddings) if config is not None else run.model.tie_embeddings
    fine = bool(run.model.path) and has_weights(run.model.path)
    softcapped = getattr(config, "final_logit_softcapping", None) is not None
    return recipe_for(mode=choice.mode, width=width, steps=run.train.steps, fine_tuning=fine, tied=tied,
                      softcapped=softcapped)


def written_rates(run, choice, overrides) -> dict[str, float]:
    """The ``RATE_KEYS`` a plan writes: the recipe's, unless the planner's command line set the rate (then the run's
    own scales too, unless a scale was set as well: a rate given is every parameter's)."""
    rec = run_recipe(run, choice)
    given = user_set(overrides, "method.lr")
    return {key: getattr(run.method if given or user_set(overrides, f"method.{key}") else rec, key)
            for key in RATE_KEYS}


def user_set(overrides: list[str] | tuple[str, ...], key: str) -> bool:
    """Whether ``key`` was given on the planner's command line (``key=value``, ``+key=``, ``++key=``)."""
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)
