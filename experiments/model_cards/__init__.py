"""Model cards: config-only Hugging Face folders (``<card>/config.json``, no weights) of the models people train
today, selected with ``model=<card>`` (e.g. ``model=llama3.1-8b``) and built with random init from their config.

Each ``config.json`` holds the published values of the Hugging Face repository named in its ``_name_or_path``
(shapes, vocabulary, tied embeddings, RoPE settings, maximum positions); docs/model_cards.md lists them.
``card_params`` counts a card's parameters from its shapes alone (no model built): the check a dry run's parameter
bytes are held to.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

CARDS_DIR = Path(__file__).resolve().parent
# decoder layer norms (RMSNorm weights of hidden_size) per architecture: Gemma 2 normalises both sublayers'
# inputs and outputs
LAYER_NORMS = {"llama": 2, "mistral": 2, "qwen2": 2, "gemma2": 4}
QKV_BIAS = {"qwen2"}  # q_proj, k_proj, v_proj carry a bias


def card_names() -> tuple[str, ...]:
    return tuple(sorted(p.parent.name for p in CARDS_DIR.glob("*/config.json")))


def card_dir(name: str) -> Path:
    return CARDS_DIR / name


@cache
def card_config(name: str) -> dict:
    """The card's ``config.json`` as a dict (a ``ValueError`` naming the known cards if there is none)."""
    file = card_dir(name) / "config.json"
    if name not in card_names():
        raise ValueError(f"model.card={name!r} is not a model card; known: {', '.join(card_names())}")
    return json.loads(file.read_text(encoding="utf-8"))


# ModelConfig fields a card's config.json sets (what its runs record); the folder is what is built
CARD_FIELDS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
               "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
               "tie_embeddings": "tie_word_embeddings"}


def card_fields(name: str) -> dict:
    """``model=<card>``'s ``ModelConfig`` fields: its name and the shape its config.json states."""
    config = card_config(name)
    shape = {key: config[hf] for key, hf in CARD_FIELDS.items() if hf in config}
    # Gemma 2's attention soft-caps its logits, which transformers' SDPA path does not: it refuses sdpa
    attention = {"attn_implementation": "eager"} if config["model_type"] == "gemma2" else {}
    return {"name": name, "card": name, **shape, **attention}


def card_params(config: dict, *, layers: int | None = None) -> int:
    """Parameters of the decoder ``config`` (a card's config.json) describes, from its shapes: the embedding
    (V×H), per layer the grouped-query attention's q/k/v/o projections (+ q/k/v biases where the architecture has
    them), the gated MLP's three projections and the RMSNorm weights, the final norm and the LM head (none when
    tied to the embedding). ``layers`` overrides ``num_hidden_layers`` (a cut of the model)."""
    arch = config["model_type"]
    if arch not in LAYER_NORMS:
        raise ValueError(f"card_params knows {sorted(LAYER_NORMS)}, not {arch!r}")
    h, v, i = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    q_out, kv_out = heads * d, kv * d  # widths of q_proj and of k_proj / v_proj
    attn = h * q_out + 2 * h * kv_out + q_out * h + ((q_out + 2 * kv_out) if arch in QKV_BIAS else 0)
    layer = attn + 3 * h * i + LAYER_NORMS[arch] * h
    n_layers = config["num_hidden_layers"] if layers is None else layers
    tied = config.get("tie_word_embeddings", arch == "gemma2")  # Gemma's config class ties by default
    return v * h + n_layers * layer + h + (0 if tied else v * h)
