"""QLoRA baseline (Dettmers et al., 2023): frozen 4-bit NF4 base weights (bitsandbytes ``Linear4bit``, optional
double quantization) plus trainable LoRA adapters (peft; Hu et al., 2021: W x + (alpha/r) B A x), trained with
AdamW (torch's, its kernels chosen by ``impl``: fused by default, see docs/dryrun-cuda.md; or bitsandbytes' 8-bit).
The base model's Linear layers are quantized in place, so no copy of the model is written to disk and a model of
any size can be prepared; everything else follows peft's recipe
(``prepare_model_for_kbit_training``: non-quantized parameters in fp32, input grads enabled).

Target modules: ``target_modules`` are leaf module names (Llama's projections by default); for a model that has
none of the defaults (GPT-2: ``c_attn``, ``c_proj``, ``c_fc`` are ``Conv1D``) peft's per-model-type default
is used, and a configured list matching nothing is an error naming the module names the model has.

Memory: the quantized layers are ``baselines.nf4.Linear4bit`` (bitsandbytes' layer, its 4-bit matmul's dequantized
weight visible to the meter), and a dry run (fake tensors) builds bitsandbytes' NF4 storage with
``baselines.nf4.fake_params4bit``; everything else runs the libraries' own code on fake tensors.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch import nn

from baselines.driver import OPTIMIZER_IMPLS, Built, OptimizerMethod, dist_error, torch_optimizer_impl
from hmt_core.method import trainable_parameters

OPTIMIZERS = ("adamw", "adamw8bit")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "qlora"
    fsdp2: ClassVar[bool] = False  # NF4 weights and LoRA adapters: DDP only
    lr: float = 2e-4
    weight_decay: float = 0.0
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    double_quant: bool = True
    compute_dtype: str = "bf16"
    optimizer: str = "adamw"
    impl: str = "fused"  # optimizer=adamw: torch.optim.AdamW's kernels, fused | foreach | single

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"method.lr must be > 0, got {self.lr}")
        if self.lora_r <= 0:
            raise ValueError(f"method.lora_r must be > 0, got {self.lora_r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"method.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"method.optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"method.impl must be one of {OPTIMIZER_IMPLS}, got {self.impl!r}")
        if self.impl != "fused" and self.optimizer != "adamw":
            raise ValueError(f"method.impl={self.impl} chooses torch.optim.AdamW's kernels; it needs "
                             "method.optimizer=adamw (bitsandbytes' AdamW8bit runs its own fused kernel)")
        if self.compute_dtype not in ("bf16", "fp32", "fp16"):
            raise ValueError(f"method.compute_dtype must be bf16|fp32|fp16, got {self.compute_dtype!r}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def check(self, run: Any) -> None:
        """Nothing else in the run clashes with these settings (``hmt_core.method.MethodConfig``)."""

    def dist_error(self, dist: Any) -> str | None:
        return dist_error(self.name, dist)


_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _linear_kinds() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def resolve_target_modules(model: nn.Module, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The LoRA target module names (leaf names, as peft matches them) for ``model``: the configured
    ``targets`` that exist; with the default Llama-style targets and none of them present (GPT-2's ``c_attn``,
    ...), peft's own per-model-type default; otherwise a ``ValueError`` listing the names the model has (the
    harness reports it as the user's input in one line)."""
    present = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                                 if isinstance(module, _linear_kinds()) and module.weight.dim() == 2))
    matched = tuple(t for t in targets if t in present)
    if matched:
        return matched
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    peft_default = tuple(t for t in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type, ())
                         if t in present)
    if tuple(targets) == DEFAULT_TARGETS and peft_default:
        print(f"qlora: {model_type} has none of the default target modules {list(DEFAULT_TARGETS)}; using peft's "
              f"default for {model_type}: {list(peft_default)} (set method.target_modules to choose)", file=sys.stderr)
        return peft_default
    hint = f"; peft's default for {model_type}: {list(peft_default)}" if peft_default else ""
    raise ValueError(f"method.target_modules={list(targets)} match no Linear/Conv1D module of {model_type}; "
                    f"names look like: {', '.join(present[:8]) or '(none)'}{hint}")


def quantize_linear_nf4(model: nn.Module, targets: tuple[str, ...], *, compute_dtype: torch.dtype,
                        double_quant: bool) -> int:
    """Replace every ``nn.Linear`` (or ``transformers`` ``Conv1D``, GPT-2's layer: ``y = x W + b`` with ``W``
    stored (in, out), so its transpose is the ``nn.Linear`` weight) whose name ends in one of ``targets`` by a
    frozen NF4 ``Linear4bit``."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    from baselines.nf4 import Linear4bit, fake_params4bit  # imports bitsandbytes: only when qlora quantizes

    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not (isinstance(child, _linear_kinds()) and child_name in targets):
                continue
            weight = child.weight.data.t() if isinstance(child, Conv1D) else child.weight.data  # (out, in)
            out_features, in_features = weight.shape
            fake = is_fake(weight)
            with unset_fake_temporarily() if fake else contextlib.nullcontext():  # an empty meta-device shell
                q = Linear4bit(in_features, out_features, bias=child.bias is not None, compute_dtype=compute_dtype,
                               compress_statistics=double_quant, quant_type="nf4", device="meta")
            if fake:  # a dry run: the same storage, built by bitsandbytes' fake-tensor ops (baselines/nf4.py)
                q.weight = fake_params4bit(weight.to(compute_dtype), double_quant=double_quant)
            else:
                q.weight = bnb.nn.Params4bit(weight.to(compute_dtype).contiguous(), requires_grad=False,
                                             compress_statistics=double_quant, quant_type="nf4")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            if not fake:
                q = q.to(child.weight.device)  # .to() quantizes
            # bitsandbytes repacks NF4 weights in place for its AVX512-BF16 CPU inference kernel the first time an
            # eval-mode forward runs (and requires out_features % 32 == 0 for it); keep one layout for train and eval
            q.support_avx512bf16_for_cpu = False
            setattr(parent, child_name, q)
            replaced += 1
    if replaced == 0:
        raise ValueError(f"method.target_modules={list(targets)} matched no nn.Linear/Conv1D in the model")
    return replaced


def prepare(model: nn.Module, config: Config) -> nn.Module:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    c = config
    targets = resolve_target_modules(model, c.target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    quantize_linear_nf4(model, targets, compute_dtype=_TORCH_DTYPES[c.compute_dtype], double_quant=c.double_quant)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                      target_modules=list(targets), task_type="CAUSAL_LM", bias="none")
    fake = any(is_fake(p) for p in model.parameters())
    with _module_to_by_data() if fake else contextlib.nullcontext():
        return get_peft_model(model, lora)


@contextlib.contextmanager
def _module_to_by_data():
    """A dry run's ``get_peft_model``. peft moves each new adapter (and the wrapped layer) to its base layer's device
    and compute dtype with ``nn.Module.to()``, which swaps fake parameters (``torch.utils.swap_tensors``) and fails:
    torch keeps a weak reference to every fake tensor it made. While peft runs, ``Module.to`` converts the way torch
    converts real parameters instead: ``param.data = param.data.to(device, dtype)`` (floating-point dtypes only), or
    a new parameter where the device changes (fake CUDA base layers: ``.data =`` cannot move a fake tensor)."""

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)

        def convert(t):
            return t.to(device, dtype if t.is_floating_point() or t.is_complex() else None, non_blocking)

        for module in self.modules():
            for key, p in module._parameters.items():
                if p is None:
                    continue
                moved = convert(p.data)
                if moved.device != p.device:  # a fake tensor's device is fixed at birth: a new parameter
                    module._parameters[key] = nn.Parameter(moved, p.requires_grad)
                else:
                    p.data = moved
            for key, b in module._buffers.items():
                if b is not None:
                    module._buffers[key] = convert(b)
        return self

    original = nn.Module.to
    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


def build(model: nn.Module, config: Config) -> Built:
    import bitsandbytes as bnb

    c = config
    params = trainable_parameters(model)
    if c.optimizer == "adamw8bit":
        opt = bnb.optim.AdamW8bit(params, lr=c.lr, weight_decay=c.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay, **torch_optimizer_impl(c.impl))
    quantized = sum(1 for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    return Built(opt, summary={"quantized_linear_layers": quantized, "lora_r": c.lora_r})


def make(config: Config) -> OptimizerMethod:
    return OptimizerMethod("qlora", build=functools.partial(build, config=config),
                           prepare=functools.partial(prepare, config=config))
