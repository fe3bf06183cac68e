"""Fused linear + cross-entropy: the causal-LM loss and its gradients from the final hidden states and the LM
head's weight, without ever materializing the (tokens x vocab) logits (Liger-Kernel's fused linear cross entropy,
Hsu et al. 2024, Sec. 3.2; Cut Cross-Entropy, Wijmans et al. 2024, Sec. 4). With T the tokens whose shifted label is
not ``ignore_index``, z = φ(h Wᵀ + b) the logits after the architecture's final map φ (identity; a scale for Cohere
and Granite; a soft-cap c·tanh(z/c) for Gemma 2) and g the incoming gradient:

    loss      = (1/|T|) Σ_{i∈T} (lse_i − z_{i,y_i}),          lse_i = log Σ_v exp z_{iv}
    ∂loss/∂z  = g·[i∈T]/|T| · (exp(z_{iv} − lse_i) − [v = y_i])    (softmax minus one-hot)
    δ         = ∂loss/∂z ⊙ φ',    ∂/∂h = δ W,    ∂/∂W = δᵀ h,    ∂/∂b = Σ_i δ_i

(transformers' ``ForCausalLMLoss``). Forward keeps only the per-token lse; backward recomputes logit blocks. Design
notes (dtypes, memory, why backward recomputes): docs/design/hmt_core_notes.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hmt_core.int8_weights import Int8Linear, dequantize
from hmt_core.precision import chunk_rows_for

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss default

# model_type -> (scale s, soft-cap c or None) of the map φ its *ForCausalLM applies to lm_head's output before the
# loss. Each entry is checked against the model's own ``labels=`` loss in tests/test_fused_ce.py.
FINAL_LOGIT_MAPS: dict[str, Callable[[object], tuple[float, float | None]]] = {
    "llama": lambda c: (1.0, None),
    "mistral": lambda c: (1.0, None),
    "qwen2": lambda c: (1.0, None),
    "gpt2": lambda c: (1.0, None),
    "gemma2": lambda c: (1.0, c.final_logit_softcapping),  # logits / c; tanh; * c
    "cohere": lambda c: (float(c.logit_scale), None),  # logits * logit_scale
    "granite": lambda c: (1.0 / float(c.logits_scaling), None),  # logits / logits_scaling
}


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """labels: (B, T) -> (B, T): position t predicts labels[t + 1]; the last position is ``ignore_index``."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def compute_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's on this device when it is on, else the input's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, *, dtype: torch.dtype, scale: float,
                softcap: float | None) -> Tensor:
    """hidden: (n, H), weight: (v, H), bias: (v,) | None -> φ(h Wᵀ + b): (n, v) fp32, a fresh tensor (the
    matmul in ``dtype``, its output upcast, then φ in place)."""
    z = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def chunk_loss_sum(z: Tensor, labels: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """z: (n, V) fp32 logits (overwritten), labels: (n,), valid: (n,) bool -> (Σ_valid (lse − z_y): 0-dim fp32,
    lse: (n,) fp32)."""
    target = z.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    peak = z.amax(dim=1)
    lse = z.sub_(peak.unsqueeze(1)).exp_().sum(dim=1).log_().add_(peak)
    return torch.where(valid, lse - target, 0.0).sum(), lse


def block_grad_logits(z: Tensor, labels: Tensor, lse: Tensor, row_scale: Tensor, *, start: int, scale: float,
                      softcap: float | None) -> Tensor:
    """z: (N, Vb) fp32 logits φ(·) of vocabulary ids [start, start + Vb) (overwritten), labels, lse, row_scale:
    (N,) -> δ: (N, Vb) fp32 = row_scale · (softmax − one-hot) ⊙ φ'; ``row_scale`` is g/|T| on valid rows, else 0."""
    width = z.shape[1]
    deriv = (z / softcap).square_().neg_().add_(1.0) if softcap is not None else None  # 1 − tanh²
    d = z.sub_(lse.unsqueeze(1)).exp_()
    in_block = (labels >= start) & (labels < start + width)  # ignore_index (< 0) is never in a block
    d.scatter_add_(1, (labels - start).clamp(0, width - 1).unsqueeze(1), -in_block.to(d.dtype).unsqueeze(1))
    d.mul_(row_scale.unsqueeze(1))
    if deriv is not None:
        d.mul_(deriv)
    if scale != 1.0:
        d.mul_(scale)
    return d


class LinearCrossEntropy(torch.autograd.Function):
    """Mean next-token cross-entropy of φ(hidden Wᵀ + b) against already-shifted labels; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk_tokens: int,
                scale: float, softcap: float | None, update: HeadUpdate | None = None) -> Tensor:
        # hidden: (N, H), weight: (V, H), bias: (V,) | None, labels: (N,) int64 (shifted) -> loss: () fp32
        dtype = compute_dtype(hidden)
        n = hidden.shape[0]
        valid = labels != IGNORE_INDEX
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit below
            for s in range(0, n, chunk_tokens):
                e = min(n, s + chunk_tokens)
                z = head_logits(hidden[s:e], weight, bias, dtype=dtype, scale=scale, softcap=softcap)
                part, lse[s:e] = chunk_loss_sum(z, labels[s:e], valid[s:e])
                del z
                total += part
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, labels, lse, count)
        ctx.meta, ctx.update = (chunk_tokens, dtype, scale, softcap), update
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor):  # grad_loss: () -> grads of (hidden, weight, bias), None for the rest
        hidden, weight, bias, labels, lse, count = ctx.saved_tensors
        chunk_tokens, dtype, scale, softcap = ctx.meta
        grads = vocab_block_grads(hidden, lambda s, e: weight[s:e].to(dtype), weight, bias, labels, lse, count,
                                  grad_loss, chunk_tokens=chunk_tokens, dtype=dtype, scale=scale, softcap=softcap,
                                  needs=ctx.needs_input_grad[:3], update=ctx.update)
        return (*grads, None, None, None, None, None)


def vocab_block(n: int, v: int, chunk_tokens: int) -> int:
    """Vocabulary ids per block: N·Vb ≤ chunk_tokens·V logits (≥ 1 column)."""
    return min(v, max(1, -(-chunk_tokens * v // n)))


class HeadUpdate(Protocol):
    """The LM head's optimizer update by vocabulary block inside the fused loss's backward (``method.head_update=
    in_loss``, ``hmt_core.optim.head_update``): the weight then never gets a (V, H) gradient. Two walks over the
    blocks: ``observe`` sees every block's gradient rows (what a tensor-wide statistic needs), ``prepare`` decides
    the step, ``apply`` updates each block's rows from its gradient rows (recomputed, the same values)."""

    def begin(self) -> None: ...

    def observe(self, start: int, grad_rows: Tensor) -> None: ...  # grad_rows: (Vb, H), rows [start, start + Vb)

    def prepare(self) -> None: ...

    def apply(self, start: int, grad_rows: Tensor) -> None: ...  # grad_rows: (Vb, H)


IN_LOSS_UPDATE = "hmt_head_update"  # attribute of the LM head module: its ``HeadUpdate`` (set by HMT's attach)


def vocab_block_grads(hidden: Tensor, rows: Callable[[int, int], Tensor], weight: Tensor, bias: Tensor | None,
                      labels: Tensor, lse: Tensor, count: Tensor, grad_loss: Tensor, *, chunk_tokens: int,
                      dtype: torch.dtype, scale: float, softcap: float | None, needs: tuple[bool, ...],
                      block: int = 0, update: HeadUpdate | None = None,
                      ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of (hidden (N, H), weight (V, H), bias (V,)) walking vocabulary blocks (module docstring) of
    ``block`` ids (0: ``vocab_block``); ``rows(s, e)``: the weight's rows [s, e) in ``dtype`` ((Vb, H): a slice, or
    an INT8 block dequantized). ``update``: the weight's rows are handed to it instead (``HeadUpdate``; one more
    walk first), and its gradient is None."""
    need_h, need_w, need_b = needs
    n, v = hidden.shape[0], weight.shape[0]
    block = block or vocab_block(n, v, chunk_tokens)
    row_scale = torch.where(labels != IGNORE_INDEX, grad_loss.float() / count, 0.0)  # (N,)
    update = update if need_w else None
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit below
        h = hidden.to(dtype)

        def walk(emit: Callable[[int, int, Tensor, Tensor], None]) -> None:
            for s in range(0, v, block):
                e = min(v, s + block)
                w = rows(s, e)
                z = head_logits(h, w, None if bias is None else bias[s:e], dtype=dtype, scale=scale, softcap=softcap)
                d = block_grad_logits(z, labels, lse, row_scale, start=s, scale=scale, softcap=softcap)
                del z
                d = d.to(dtype)  # (N, Vb): the fp32 block is freed here (the plain path rounds δ to dtype too)
                emit(s, e, w, d)
                del d, w

        if update is not None:
            update.begin()
            walk(lambda s, e, w, d: update.observe(s, torch.mm(d.t(), h)))  # (Vb, H): the rows the plain path writes
            update.prepare()
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = (torch.empty((v, hidden.shape[1]), dtype=dtype, device=hidden.device) if need_w and update is None
                  else None)
        grad_b = torch.empty(v, dtype=dtype, device=hidden.device) if need_b else None

        def emit(s: int, e: int, w: Tensor, d: Tensor) -> None:  # d: (N, Vb), w: (Vb, H)
            if need_h:
                grad_h.add_(d @ w)  # (N, Vb) @ (Vb, H)
            if update is not None:
                update.apply(s, torch.mm(d.t(), h))
            elif need_w:
                torch.mm(d.t(), h, out=grad_w[s:e])  # (Vb, N) @ (N, H): these rows are final
            if need_b:
                grad_b[s:e] = d.sum(dim=0)

        walk(emit)
    return (None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype))


class Int8HeadCrossEntropy(torch.autograd.Function):
    """``LinearCrossEntropy`` for an INT8 head (``hmt_core.int8_weights``: ``method.embedding_dtype=int8``): forward
    walks vocabulary blocks too, dequantizing one (Vb, H) block at a time (never the whole (V, H) weight), and
    merges the blocks' log-sum-exps, lse = log Σ_blocks exp(lse_block) (Cut Cross-Entropy's forward); backward is
    the same block walk as the BF16 head's, each block dequantized again. A block is also at most one row chunk of
    the dequantized weight (``hmt_core.precision.chunk_rows_for``: 16 MiB on CUDA), so that block stays small too:
    with N·Vb ≤ chunk_tokens·V alone, a 2048-token sequence would dequantize half a 128k vocabulary at once."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk_tokens: int,
                scale: float, softcap: float | None, layer: nn.Module, update: HeadUpdate | None = None) -> Tensor:
        # hidden: (N, H), weight: the phantom (V, H) (its gradient edge), labels: (N,) shifted -> loss: () fp32
        dtype = compute_dtype(hidden)
        n, v = hidden.shape[0], weight.shape[0]
        block = int8_block(hidden, v, chunk_tokens, dtype)
        valid = labels != IGNORE_INDEX
        lse = torch.full((n,), -math.inf, dtype=torch.float32, device=hidden.device)
        target = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit below
            h = hidden.to(dtype)
            for s in range(0, v, block):
                e = min(v, s + block)
                z = head_logits(h, int8_rows(layer, s, e, dtype), None if bias is None else bias[s:e], dtype=dtype,
                                scale=scale, softcap=softcap)  # (N, Vb) fp32
                inside = (labels >= s) & (labels < e)
                picked = z.gather(1, (labels - s).clamp(0, e - s - 1).unsqueeze(1)).squeeze(1)
                target += torch.where(inside, picked, 0.0)
                torch.logaddexp(lse, torch.logsumexp(z, dim=1), out=lse)
                del z
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, labels, lse, count)
        ctx.meta, ctx.layer, ctx.update = (chunk_tokens, dtype, scale, softcap), layer, update
        return torch.where(valid, lse - target, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor):  # grad_loss: () -> grads of (hidden, weight, bias), None for the rest
        hidden, weight, bias, labels, lse, count = ctx.saved_tensors
        chunk_tokens, dtype, scale, softcap = ctx.meta
        layer = ctx.layer
        grads = vocab_block_grads(hidden, lambda s, e: int8_rows(layer, s, e, dtype), weight, bias, labels, lse,
                                  count, grad_loss, chunk_tokens=chunk_tokens, dtype=dtype, scale=scale,
                                  softcap=softcap, needs=ctx.needs_input_grad[:3],
                                  block=int8_block(hidden, weight.shape[0], chunk_tokens, dtype), update=ctx.update)
        return (*grads, None, None, None, None, None, None)


def int8_block(hidden: Tensor, v: int, chunk_tokens: int, dtype: torch.dtype) -> int:
    """Vocabulary ids per block of an INT8 head: ``vocab_block``, and at most one row chunk of (V, H) ``dtype``."""
    return min(vocab_block(hidden.shape[0], v, chunk_tokens), chunk_rows_for((v, hidden.shape[1]), dtype, like=hidden))


def int8_rows(layer: nn.Module, s: int, e: int, dtype: torch.dtype) -> Tensor:  # -> (e − s, H) dtype
    """Rows [s, e) of an ``Int8Linear`` head dequantized: q[s:e]·s[s:e], the same values as those rows of the
    whole dequantized weight."""
    return dequantize(layer.weight_codes[s:e], layer.weight_scales[s:e], layer.block, dtype, backend=layer.backend)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, *,
                         chunk_tokens: int = 1024, scale: float = 1.0, softcap: float | None = None,
                         int8_head: nn.Module | None = None, head_update: HeadUpdate | None = None) -> Tensor:
    """hidden: (B, T, H), weight: (V, H), bias: (V,) | None, labels: (B, T) unshifted (``ignore_index`` = -100
    where no loss) -> the mean next-token cross-entropy (0-dim fp32) of φ(hidden Wᵀ + b), as
    ``ForCausalLMLoss(lm_head(hidden), labels)``, in chunks of ``chunk_tokens`` tokens. ``int8_head``: an
    ``Int8Linear`` head whose phantom is ``weight`` (``Int8HeadCrossEntropy``). ``head_update``: the head's update by
    vocabulary block in backward (``HeadUpdate``); ``weight`` then gets no gradient."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    if int8_head is not None:
        return Int8HeadCrossEntropy.apply(flat, weight, bias, shift_labels(labels).reshape(-1), chunk_tokens, scale,
                                          softcap, int8_head, head_update)
    return LinearCrossEntropy.apply(flat, weight, bias, shift_labels(labels).reshape(-1), chunk_tokens, scale,
                                    softcap, head_update)


@dataclass(frozen=True)
class LMHead:
    """The output embedding of a causal LM and the final map φ its forward applies to the head's output."""

    module: nn.Linear  # or an Int8Linear (method.embedding_dtype=int8)
    scale: float
    softcap: float | None


def resolve_head(model: nn.Module) -> LMHead:
    """The LM head of ``model`` (through a DDP or PEFT wrapper: ``.module``, ``get_base_model()``), or ValueError
    naming why the fused loss cannot stand in for the model's own: an architecture whose final logit map is unknown
    here, or a head that is not a plain ``nn.Linear`` (an adapter or a quantized layer on it)."""
    base = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    get_base = getattr(base, "get_base_model", None)  # peft's PeftModel
    base = get_base() if callable(get_base) else base
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    rule = FINAL_LOGIT_MAPS.get(model_type)
    if rule is None:
        raise ValueError(f"train.fused_ce=true: model type {model_type!r} ({type(base).__name__}) is not one whose "
                         f"final logit map (scale, soft-cap) is known to the fused loss ({sorted(FINAL_LOGIT_MAPS)}); "
                         "set train.fused_ce=false to use the model's own loss")
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) not in (nn.Linear, Int8Linear) or getattr(head, "transposed", False):
        raise ValueError(f"train.fused_ce=true: the output embedding of {type(base).__name__} is "
                         f"{type(head).__name__}, not a plain nn.Linear (an adapter or quantization on lm_head?); "
                         "set train.fused_ce=false to use the model's own loss")
    scale, softcap = rule(config)
    return LMHead(module=head, scale=float(scale), softcap=None if softcap is None else float(softcap))


def causal_lm_loss(model: nn.Module, input_ids: Tensor, labels: Tensor | None = None, *,
                   chunk_tokens: int = 1024) -> Tensor:
    """``model(input_ids=input_ids, labels=labels).loss`` (labels default to the inputs) with the fused loss.

    The model's own forward runs (wrappers, activation-policy scopes and hooks included); a forward pre-hook on the
    LM head computes the loss from the hidden states it is given (what the plain path's head multiplies) and hands
    the head an empty (B, 0, H) slice, so the model's logits are (B, 0, V) and never materialized."""
    head = resolve_head(model)
    labels = input_ids if labels is None else labels
    box: dict[str, Tensor] = {}

    def hook(module: nn.Linear, args: tuple, kwargs: dict):
        if "loss" in box:
            raise RuntimeError("fused cross-entropy: the LM head ran twice in one forward")
        hidden = args[0] if args else kwargs["input"]
        if hidden.shape[:-1] != labels.shape:
            raise RuntimeError(f"fused cross-entropy: the LM head's input {tuple(hidden.shape)} does not match the "
                               f"labels {tuple(labels.shape)} (hidden states sliced before the head?)")
        box["loss"] = linear_cross_entropy(hidden, module.weight, module.bias, labels, chunk_tokens=chunk_tokens,
                                           scale=head.scale, softcap=head.softcap,
                                           int8_head=module if isinstance(module, Int8Linear) else None,
                                           head_update=getattr(module, IN_LOSS_UPDATE, None))
        empty = hidden[..., :0, :]
        return ((empty, *args[1:]), kwargs) if args else (args, {**kwargs, "input": empty})

    handle = head.module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=input_ids)
    finally:
        handle.remove()
    if "loss" not in box:
        raise RuntimeError(f"fused cross-entropy: {type(model).__name__}'s forward never called its LM head")
    return box["loss"]


__all__ = ["FINAL_LOGIT_MAPS", "HeadUpdate", "IGNORE_INDEX", "IN_LOSS_UPDATE", "Int8HeadCrossEntropy",
           "LMHead", "LinearCrossEntropy", "causal_lm_loss",
           "linear_cross_entropy", "resolve_head", "shift_labels"]
