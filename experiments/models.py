"""Models: a ``transformers`` causal LM built from a phase config (random-init Llama), or from a local Hugging
Face directory (``model.path``) — any architecture ``AutoModelForCausalLM`` knows.

``model.path`` may hold weights (``*.safetensors`` / ``pytorch_model*.bin``): they are loaded with
``from_pretrained``. A directory holding only ``config.json`` is built from it with random init
(``AutoConfig`` + ``AutoModelForCausalLM.from_config``) in the target dtype, directly on the target device —
training from scratch at a published shape (Llama-2-7B, Mistral-7B, Qwen2-7B, GPT-2, ...). A dry run
(``FakeTensorMode``) always builds from the config: it needs shapes, never values. Nothing here touches the
network (``local_files_only=True``; ``trust_remote_code`` is never set).

A ``model.path`` run under a phase's name (``tiny`` by default) is named after its config instead
(``config_name``: architecture and size, e.g. ``llama-8.0b``), so its run id and reports say what it trains.

``load_hf_config`` parses and checks ``config.json`` cheaply (no model is built), so a broken file fails before
any compute with a one-line ``UserError`` naming the file and, for invalid JSON, the line and column.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from experiments.config import MODEL_PHASES, ModelConfig, RunConfig
from experiments.errors import UserError
from hmt_core.int8_weights import trained_in_place

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def llama_config(cfg: ModelConfig, vocab_size: int | None = None):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size or cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_embeddings, attn_implementation=cfg.attn_implementation, use_cache=False,
    )


def _config_file(path: str | Path) -> Path:
    return Path(path).expanduser() / "config.json"


def _read_config_dict(file: Path) -> dict:
    """``config.json`` as a dict; a missing, unreadable or non-JSON file, or one without a known causal-LM
    ``model_type``, is a ``UserError`` naming the file."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"model.path has no Hugging Face config: {file} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {file}: {e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{file} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
                        f"(char {e.pos})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if not model_type:
        raise UserError(f"{file} has no \"model_type\" (e.g. \"llama\", \"mistral\", \"qwen2\", \"gpt2\")")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        import transformers

        raise UserError(f"{file}: model_type={model_type!r} is not an architecture transformers "
                        f"{transformers.__version__} knows")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{file}: model_type={model_type!r} has no causal-LM head in transformers "
                        "(AutoModelForCausalLM); the harness trains next-token prediction")
    return raw


def load_hf_config(path: str | Path):
    """The ``transformers`` config of the local model directory ``path`` (``use_cache`` off), checked: raises
    ``UserError`` naming ``<path>/config.json`` when it is missing, not JSON (with line/column), lacks
    ``model_type``, names an unknown or non-causal-LM architecture, or holds values its config class rejects.
    Cheap: reads one small file, builds no model, never touches the network."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    file = _config_file(path)
    _read_config_dict(file)
    try:
        config = AutoConfig.from_pretrained(str(file.parent), local_files_only=True, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{file}: transformers rejects this config ({type(e).__name__}: {first})") from None
    except StrictDataclassError as e:  # a config class's validator (hidden_size not a multiple of the heads, ...)
        cause = e.__cause__ or e
        raise UserError(f"{file}: transformers rejects this config ({type(cause).__name__}: "
                        f"{' '.join(str(cause).split())})") from None
    config.use_cache = False
    return config


def has_weights(path: str | Path) -> bool:
    """Whether the directory holds weight files ``from_pretrained`` reads (safetensors or PyTorch ``.bin``)."""
    root = Path(path).expanduser()
    return any(next(root.glob(pattern), None) is not None for pattern in WEIGHT_GLOBS)


def _in_fake_mode() -> bool:
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def model_source(cfg: ModelConfig, *, shapes_only: bool = False) -> str:
    """How ``build_model`` makes the model: ``"phase"`` (the harness's Llama shape, random init), ``"config"``
    (``model.path`` holds only config.json, or a dry run: random init from the config) or ``"weights"``
    (``from_pretrained``). ``shapes_only=True`` (``mode=dryrun``) answers for a dry run from outside one; inside
    ``FakeTensorMode`` that is detected."""
    if not cfg.hf_dir:
        return "phase"
    return "weights" if has_weights(cfg.hf_dir) and not (shapes_only or _in_fake_mode()) else "config"


def model_vocab_size(cfg: ModelConfig) -> int:
    """Embedding rows of the model ``cfg`` describes: ``config.json``'s ``vocab_size`` when ``model.path`` is
    set, else ``model.vocab_size``; the size to train a tokenizer for."""
    if cfg.hf_dir:
        return int(load_hf_config(cfg.hf_dir).vocab_size)
    return cfg.vocab_size


def max_positions(cfg: ModelConfig) -> int | None:
    """Longest sequence the model's position table covers: ``config.json``'s ``max_position_embeddings`` (GPT-2:
    ``n_positions``) when ``model.path`` is set, else ``model.max_position_embeddings``; None when the config
    states none."""
    if not cfg.hf_dir:
        return cfg.max_position_embeddings
    config = load_hf_config(cfg.hf_dir)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


SDPA_CAUSAL = "sdpa_causal"  # torch SDPA with is_causal=True and no mask: HMT's batches are never padded


def build_model(cfg: ModelConfig, *, vocab_size: int | None = None, device: torch.device | str = "cpu"):
    """``_build_model``, then ``causal_attention_without_mask``."""
    return causal_attention_without_mask(_build_model(cfg, vocab_size=vocab_size, device=device))


def causal_attention_without_mask(model):
    """A model on ``sdpa`` whose layers all attend causally over the full sequence switches to ``SDPA_CAUSAL``: the
    same ``transformers`` SDPA function, registered under a name that has no mask function
    (``transformers.AttentionInterface``), so the model builds no mask and SDPA runs with ``is_causal=True``.

    Bit for bit what ``sdpa`` computes on an unpadded batch (its mask builder returns no mask there, leaving
    ``is_causal`` to SDPA), without its host syncs: ``find_packed_sequence_indices`` reads the position ids on the
    host once per forward to look for packed sequences. Every batch HMT trains or validates on is rows of
    ``train.seq_len`` tokens with no padding and no packed-sequence position ids. Models with sliding-window or
    other non-causal layers (Gemma 2's ``layer_types``) keep ``sdpa`` and its mask."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    config = model.config
    layer_types = getattr(config, "layer_types", None)
    full = all(t == "full_attention" for t in layer_types) if layer_types else getattr(config, "sliding_window",
                                                                                           None) is None
    if config._attn_implementation != "sdpa" or not full:
        return model
    if SDPA_CAUSAL not in AttentionInterface._global_mapping:
        AttentionInterface.register(SDPA_CAUSAL, sdpa_attention_forward)
    model.set_attn_implementation(SDPA_CAUSAL)
    return model


def _build_model(cfg: ModelConfig, *, vocab_size: int | None = None, device: torch.device | str = "cpu"):
    """The model ``cfg`` describes, in ``cfg.dtype`` on ``device``: a random-init Llama of the phase's shape,
    or the local model at ``cfg.path`` (``from_pretrained`` with weights, ``from_config`` without; see
    ``model_source``). ``vocab_size``: the tokenizer's size; a phase model gets that many embedding rows, a
    ``cfg.path`` model keeps its config's and must have at least that many."""
    dtype = TORCH_DTYPES[cfg.dtype]
    if not cfg.hf_dir:
        return _in_dtype_on_device(lambda: _llama_from_phase(cfg, vocab_size), dtype, device)
    config = load_hf_config(cfg.hf_dir)
    file = _config_file(cfg.hf_dir)
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise UserError(f"the tokenizer has {vocab_size} tokens but {file} has vocab_size={config.vocab_size}")
    source = model_source(cfg)
    arch = architecture_name(config)
    try:
        if source == "weights":
            from transformers import AutoModelForCausalLM

            print(f"model: {arch} loaded from {cfg.hf_dir} (weights)", file=sys.stderr)
            model = AutoModelForCausalLM.from_pretrained(
                str(Path(cfg.hf_dir).expanduser()), config=config, dtype=dtype,
                attn_implementation=cfg.attn_implementation, local_files_only=True, trust_remote_code=False)
            model.config.use_cache = False
            return model.to(device)
        why = "dry run: shapes only" if has_weights(cfg.hf_dir) else "no weights there"
        print(f"model: {arch} random init from {file} ({why})", file=sys.stderr)
        return _in_dtype_on_device(lambda: _from_config(config, dtype, cfg.attn_implementation), dtype, device)
    except ValueError as e:  # e.g. an attention implementation this architecture does not support
        if isinstance(e, UserError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"building {arch} from {file} with model.attn_implementation={cfg.attn_implementation} "
                        f"failed: {first}") from None


def architecture_name(config) -> str:
    """The ``AutoModelForCausalLM`` class name for ``config`` (``GPT2LMHeadModel``, ``Qwen2ForCausalLM``, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type) or config.model_type


def config_name(path: str | Path) -> str:
    """``<model_type>-<size>`` of the config at ``path``: parameters counted on the meta device (no memory, tied
    weights once), in billions with one decimal (``llama-8.0b``) or below a billion in millions (``qwen2-494m``)."""
    config = load_hf_config(path)
    with torch.device("meta"):
        model = _from_config(config, torch.bfloat16, "sdpa")
    n = sum(p.numel() for p in model.parameters())
    return f"{config.model_type}-{n / 1e9:.1f}b" if n >= 1e9 else f"{config.model_type}-{round(n / 1e6)}m"


def with_config_name(run: RunConfig) -> RunConfig:
    """``run`` with its model named after ``model.path``'s config when the name is a phase's (``model=tiny`` is
    the default): the phase's name would claim a shape ``model.path`` replaces. A name given on the command line
    (``model.name=...``) or a card's (``model=llama3.1-8b``) is kept."""
    if not run.model.path or run.model.name not in MODEL_PHASES:
        return run
    try:
        name = config_name(run.model.path)
    except (ValueError, OSError, KeyError):  # a config transformers cannot build: the run says so when it builds
        return run  # the model (one line, as a run's error); a sweep's other runs go on
    return dataclasses.replace(run, model=dataclasses.replace(run.model, name=name))


def _llama_from_phase(cfg: ModelConfig, vocab_size: int | None):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(cfg, vocab_size))


def _from_config(config, dtype: torch.dtype, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                             trust_remote_code=False)
    model.config.use_cache = False
    return model


def _in_dtype_on_device(make, dtype: torch.dtype, device: torch.device | str):
    """``make()`` with ``dtype`` as the default dtype inside ``torch.device(device)``: parameters are born in the
    target dtype on the target device (no fp32 copy first), which also holds under FakeTensorMode."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) element counts; a 4-bit packed weight counts its logical elements, and so does an INT8
    weight (``hmt_core.int8_weights``: its phantom ``weight``, trainable; its codes and scales are storage)."""
    total = trainable = 0
    for p in model.parameters():
        if trained_in_place(p):
            continue
        n = p.numel()
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        if shape is not None:
            n = int(torch.Size(shape).numel())
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable
