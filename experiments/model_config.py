"""The ``model`` section of the run configuration (``experiments.config``): ``ModelConfig``, the harness's Llama
shapes by size (``MODEL_PHASES``) and the checks of a committed model card (``experiments.model_cards``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.config_checks import one_of, positive
from experiments.model_cards import CARD_FIELDS, card_dir, card_fields

DTYPES = ("bf16", "fp32", "fp16")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "tiny"
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    intermediate_size: int = 688
    vocab_size: int = 4096
    max_position_embeddings: int = 4096
    path: str | None = None  # a local Hugging Face model directory (config + weights); overrides the shape
    dtype: str = "bf16"  # weight storage dtype
    attn_implementation: str = "sdpa"
    tie_embeddings: bool = False
    card: str | None = None  # a committed config-only folder, experiments/model_cards/<card> (model=<card>)

    def __post_init__(self) -> None:
        positive("model", self, "hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size")
        if self.card is not None:
            _check_card(self)
        one_of("model", "dtype", self.dtype, DTYPES)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} not divisible by model.num_heads={self.num_heads}")
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must be > 0 and divide model.num_heads="
                             f"{self.num_heads} (grouped-query attention: each key/value head serves "
                             "num_heads/num_kv_heads query heads)")
        if self.path is not None:
            if not (Path(self.path).expanduser() / "config.json").exists():
                raise FileNotFoundError(f"model.path has no Hugging Face model (config.json): {self.path}")

    @property
    def hf_dir(self) -> str | None:
        """The Hugging Face folder the model is built from: ``model.path``, or the card's committed folder; None
        for the harness's own Llama shape (the fields above)."""
        if self.path:
            return self.path
        return str(card_dir(self.card)) if self.card else None


def _check_card(model: ModelConfig) -> None:
    """A card is built from its folder: a shape field overridden on the command line would be silently ignored,
    so it is refused, as is a card together with ``model.path``."""
    if model.path is not None:
        raise ValueError(f"model.card={model.card} and model.path={model.path} both name the model; use one")
    for key, value in card_fields(model.card).items():
        if key in CARD_FIELDS and getattr(model, key) != value:  # the shape, not the name or attention kernel
            raise ValueError(f"model.{key}={getattr(model, key)} differs from card {model.card}'s {CARD_FIELDS[key]}="
                             f"{value} ({card_dir(model.card)}/config.json): a card's shape is its config.json; "
                             "copy that folder, edit it and pass model.path=<folder>")


MODEL_PHASES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(name="small", hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024),
    # 29.5 M parameters (14 % in the embedding and LM head): the campaign's larger model (docs/campaign/findings.md)
    "30m": ModelConfig(name="30m", hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1376),
    "125m": ModelConfig(name="125m", hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048,
                        vocab_size=32000),
    "350m": ModelConfig(name="350m", hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=2736,
                        vocab_size=32000),
    "1b": ModelConfig(name="1b", hidden_size=2048, num_layers=24, num_heads=32, intermediate_size=5461,
                      vocab_size=32000),
    "3b": ModelConfig(name="3b", hidden_size=3200, num_layers=26, num_heads=32, intermediate_size=8640,
                      vocab_size=32000),
    "7b": ModelConfig(name="7b", hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008,
                      vocab_size=32000),
    "13b": ModelConfig(name="13b", hidden_size=5120, num_layers=40, num_heads=40, intermediate_size=13824,
                       vocab_size=32000),
    "70b": ModelConfig(name="70b", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       intermediate_size=28672, vocab_size=32000),
}
