"""Per-component activation policy: what autograd keeps for each part of a decoder layer.

Components (Llama-family names; the scope each one covers is fixed in ``apply.py``):
  embedding         the embedding output, as held by the first decoder layer's input norm (its input, 1/rms, x*1/rms)
  attn_qkv          what the attention block saves outside the core: the q/k/v projections' input and RoPE's saves
  attn_core         what the attention core saves (q, k, v after RoPE; softmax probs (b, a, s, s) in eager attention)
  attn_out          the attention output, as saved by o_proj
  mlp_intermediate  everything the MLP saves: its input, gate/up outputs, act(gate), act(gate)*up
  residual          tensors saved at decoder-layer scope outside the sub-blocks, and the layer inputs kept by
                    ``layer_recompute`` (in pre-norm Llama the adds save nothing: the residual stream is held by
                    the norms, i.e. by ``norm``); with ``layer_recompute`` a codec action stores those checkpointed
                    layer inputs encoded (decoded for the layer's recompute in backward)
  norm              what the other RMSNorms save (input = residual stream, 1/rms, normalized), final norm included
  lm_head           the LM head's input
Actions: keep (store as autograd would, model dtype), recompute (torch.utils.checkpoint, non-reentrant), int8, fp8,
int4_outlier, int8_outlier (codecs.py), offload_cpu (copy to host memory, back on unpack).

Presets follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
per-layer activations 34·s·b·h + 5·a·s²·b bytes (16-bit, no fused attention); ``full_ckpt`` keeps only each
layer's input (2·s·b·h) and recomputes the layer; ``selective`` recomputes only the attention core (drops the
5·a·s²·b term). ``hmt`` is the HMT design table (embedding keep, Q/K/V recompute, attention output INT8, MLP
intermediate INT8, residual / norm / LM head keep).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hmt_core.activations.codecs import FP8_DTYPES

COMPONENTS = (
    "embedding", "attn_qkv", "attn_core", "attn_out", "mlp_intermediate", "residual", "norm", "lm_head",
)
ACTIONS = ("keep", "recompute", "int8", "fp8", "int4_outlier", "int8_outlier", "offload_cpu")
CODEC_ACTIONS = ("int8", "fp8", "int4_outlier", "int8_outlier")
# Components inside a decoder layer: moot (must be keep) when the whole layer is recomputed. ``norm`` is not
# listed: norms inside layers are moot too, but the final norm runs outside the layers and still applies.
LAYER_COMPONENTS = ("embedding", "attn_qkv", "attn_core", "attn_out", "mlp_intermediate", "residual")


@dataclass(frozen=True, kw_only=True)
class ActivationPolicy:
    embedding: str = "keep"
    attn_qkv: str = "keep"
    attn_core: str = "keep"
    attn_out: str = "keep"
    mlp_intermediate: str = "keep"
    residual: str = "keep"
    norm: str = "keep"
    lm_head: str = "keep"
    layer_recompute: bool = False  # full checkpointing: each decoder layer recomputed from its input
    block_size: int = 128  # elements per quantization block
    fp8_format: str = "e4m3"  # "e4m3" | "e5m2"
    outlier_z: float = 3.0  # z-score threshold for outlier channels (Adacc)
    max_outlier_frac: float = 1 / 32  # outlier slots = ceil(frac * channels), static shapes
    # component -> module names or fnmatch globs (relative to the model root); overrides the Llama defaults and
    # is required for models that are not Llama-shaped (generic nn.Linear stacks)
    modules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for c in COMPONENTS:
            action = getattr(self, c)
            if action not in ACTIONS:
                raise ValueError(f"activation.{c}: unknown action {action!r}; expected one of {ACTIONS}")
        if self.embedding == "recompute":
            raise ValueError("activation.embedding: 'recompute' is not supported (the embedding saves only indices)")
        if self.residual == "recompute":
            raise ValueError("activation.residual: 'recompute' is not an action here; use layer_recompute: true")
        if self.attn_qkv == "recompute" and self.attn_core != "recompute":
            raise ValueError("activation.attn_core: attn_qkv=recompute recomputes the core too; "
                             "set attn_core: recompute")
        if self.layer_recompute:
            bad = [c for c in LAYER_COMPONENTS if getattr(self, c) != "keep" and c != "residual"]
            if bad:
                raise ValueError(f"activation.{bad[0]}: must be 'keep' when layer_recompute is true (nothing inside "
                                 "a recomputed layer is saved)")
            if self.residual not in ("keep", *CODEC_ACTIONS):
                raise ValueError(f"activation.residual: with layer_recompute it is how the checkpointed layer inputs "
                                 f"are stored: 'keep' or a codec {CODEC_ACTIONS}, got {self.residual!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"activation.block_size: must be a positive int, got {self.block_size!r}")
        if self.block_size % 2 and "int4_outlier" in self.actions().values():
            raise ValueError(f"activation.block_size: int4 packs two codes per byte, needs an even block, got "
                             f"{self.block_size}")
        if self.fp8_format not in FP8_DTYPES:
            raise ValueError(f"activation.fp8_format: {self.fp8_format!r} not in {tuple(FP8_DTYPES)}")
        if not 0 < self.max_outlier_frac <= 1:
            raise ValueError(f"activation.max_outlier_frac: must be in (0, 1], got {self.max_outlier_frac}")
        for key, names in self.modules.items():
            if key not in COMPONENTS:
                raise ValueError(f"activation.modules.{key}: unknown component; expected one of {COMPONENTS}")
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"activation.modules.{key}: expected a list of module names, got {names!r}")
        object.__setattr__(self, "modules", {k: tuple(v) for k, v in self.modules.items()})

    def actions(self) -> dict[str, str]:
        return {c: getattr(self, c) for c in COMPONENTS}

    def is_identity(self) -> bool:
        return not self.layer_recompute and all(a == "keep" for a in self.actions().values())

    def replace(self, **changes: Any) -> ActivationPolicy:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["modules"] = {k: list(v) for k, v in self.modules.items()}
        return d

    @staticmethod
    def preset(name: str) -> ActivationPolicy:
        if name not in PRESETS:
            raise ValueError(f"activation.preset: unknown preset {name!r}; expected one of {tuple(PRESETS)}")
        return PRESETS[name]

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ActivationPolicy:
        """``{"preset": "hmt", "attn_out": "fp8", "block_size": 64, ...}``; the preset (default none) is the base."""
        d = dict(d)
        base = ActivationPolicy.preset(d.pop("preset", "none") or "none")
        fields = {f.name for f in dataclasses.fields(ActivationPolicy)}
        for key in d:
            if key not in fields:
                raise ValueError(f"activation.{key}: unknown key; expected 'preset' or one of {sorted(fields)}")
        return base.replace(**d)

    @staticmethod
    def from_yaml(source: str | Path) -> ActivationPolicy:
        """A YAML file path or YAML text holding a mapping for ``from_dict``."""
        text = Path(source).read_text() if isinstance(source, Path) or str(source).endswith((".yaml", ".yml")) \
            else str(source)
        data = yaml.safe_load(text) or {}
        if not isinstance(data, Mapping):
            raise ValueError(f"activation: YAML must hold a mapping, got {type(data).__name__}")
        return ActivationPolicy.from_dict(data)


PRESETS: dict[str, ActivationPolicy] = {
    "none": ActivationPolicy(),
    "full_ckpt": ActivationPolicy(layer_recompute=True),
    "selective": ActivationPolicy(attn_core="recompute"),
    "hmt": ActivationPolicy(attn_qkv="recompute", attn_core="recompute", attn_out="int8", mlp_intermediate="int8"),
}
