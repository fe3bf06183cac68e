"""INT8 vocabulary matrices for HMT (``method.embedding_dtype=int8``): the input embedding and the LM head stored as
INT8 codes with the block scales of the projected INT8 weights (``hmt_core.int8_weights.codec``; Q-GaLore, Zhang et
al., 2024, §3.3) and updated like them (dequantize → update in fp32 → stochastic-round requantize, through the
``Int8Weight`` handle).

- ``Int8Embedding`` replaces a plain ``nn.Embedding`` (V, d). Its lookup gathers the codes and scales of the
  requested rows only and dequantizes those (N, d): E[ids] = q[ids]·s[ids], the rows of the dequantized matrix, bit
  for bit. Backward is ``F.embedding``'s own (``aten.embedding_dense_backward``: a dense (V, d) gradient in the
  weight's dtype, ``padding_idx`` rows zero) into the phantom's ``.grad``; nothing but the ids is saved.
- The LM head becomes an ``Int8Linear`` (``hmt_core.int8_weights.linear``); the fused cross-entropy
  (``hmt_core.fused_ce``) dequantizes it one vocabulary block at a time, never as a whole (V, d) copy.

``quantize_vocab`` converts both; tied input/output embeddings are refused (one matrix, two layers).

``Int8Rows`` is the table as the row-sparse update rules see it (``method.embedding_update=lazy_exact|sparse_adam``,
``hmt_core.optim.row_adam``, ``hmt_core.sparse_embedding``): touched rows dequantized to fp32, updated, and written
back by stochastic rounding (one draw per distinct row), so no (V, d) gradient or copy ever exists.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from collections.abc import Callable

from torch._subclasses.fake_tensor import is_fake

from hmt_core.int8_weights.codec import BLOCK, dequantize, quantize
from hmt_core.int8_weights.linear import Int8Linear, Int8Storage, Int8Weight, Materialize, _tagged
from hmt_core.precision import chunk_rows_for, random_halfwords


class Int8EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, layer: Int8Embedding) -> Tensor:
        # ids: (...) int64; weight: the phantom (V, d), only its gradient edge is used -> (..., d) weight.dtype
        flat = ids.reshape(-1)
        rows = dequantize(layer.weight_codes[flat], layer.weight_scales[flat], layer.block, weight.dtype,
                          backend=layer.backend)  # (N, d): only the gathered rows
        ctx.save_for_backward(ids)
        ctx.num, ctx.padding_idx = layer.num_embeddings, layer.padding_idx
        return rows.view(*ids.shape, rows.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # grad_out: (..., d) -> (None, (V, d), None)
        (ids,) = ctx.saved_tensors
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        grad_w = torch.ops.aten.embedding_dense_backward(grad_out, ids, ctx.num, pad, False)
        return None, grad_w, None


class Int8Embedding(Int8Storage, nn.Embedding):
    """An ``nn.Embedding`` whose table is INT8 codes (V, d) + fp32 block scales (V, ⌈d/block⌉) and a phantom
    ``weight`` (see ``hmt_core.int8_weights.linear``). Construct with ``from_module``."""

    transposed = False

    def __init__(self, codes: Tensor, scales: Tensor, *, dtype: torch.dtype, padding_idx: int | None,
                 block: int = BLOCK, backend: str | None = None) -> None:
        nn.Module.__init__(self)  # not nn.Embedding.__init__: it would allocate a full-precision table
        self.num_embeddings, self.embedding_dim = codes.shape
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.block, self.backend = block, backend
        rows, cols = codes.shape
        self.weight = _tagged(torch.empty((), dtype=dtype, device=codes.device).expand(rows, cols), "phantom", True)
        self.weight_codes = _tagged(codes, "codes", False)  # (V, d) int8
        self.weight_scales = _tagged(scales, "scales", False)  # (V, nb) fp32
        self.handle = Int8Weight(self)

    @classmethod
    @torch.no_grad()
    def from_module(cls, module: nn.Embedding, *, block: int = BLOCK, backend: str | None = None,
                    device: torch.device | None = None) -> Int8Embedding:
        """Quantize ``module``'s table (round-to-nearest, row chunks as ``Int8Linear.from_module``; ``device`` as
        there)."""
        w = module.weight.detach() if device is None else module.weight.detach().to(device)
        codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        scales = torch.empty((w.shape[0], -(-w.shape[1] // block)), dtype=torch.float32, device=w.device)
        step = chunk_rows_for(tuple(w.shape), torch.float32, like=w)
        for a in range(0, w.shape[0], step):
            codes[a:a + step], scales[a:a + step] = quantize(w[a:a + step], block)
        return cls(codes, scales, dtype=w.dtype, padding_idx=module.padding_idx, block=block, backend=backend)

    def dequantized(self, dtype: torch.dtype) -> Tensor:  # -> (V, d) dtype: export only, never in training
        return dequantize(self.weight_codes, self.weight_scales, self.block, dtype, backend=self.backend)

    def forward(self, ids: Tensor) -> Tensor:
        return Int8EmbeddingFunction.apply(ids, self.weight, self)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, int8 block={self.block}"


class Int8Rows:
    """An ``Int8Embedding``'s rows for ``hmt_core.optim.row_adam`` (its ``Rows`` protocol): ``read`` dequantizes
    rows to fp32; ``write`` requantizes fp32 rows by stochastic rounding (``quantize(..., stochastic=True)``) and
    stores their codes and block scales with ``index_copy_``. The noise is one (n, d) draw of ``generator`` per
    write, of which position i uses row ``group[i]``: positions of the same row (``group`` equal) round alike, so
    duplicates write the same codes."""

    def __init__(self, layer: Int8Embedding, generator: Callable[[torch.device], torch.Generator]) -> None:
        self.layer, self.generator = layer, generator
        self.shape = tuple(layer.weight_codes.shape)

    def read(self, ids: Tensor) -> Tensor:  # ids: (n,) -> (n, d) fp32
        layer = self.layer
        return dequantize(layer.weight_codes[ids], layer.weight_scales[ids], layer.block, torch.float32,
                          backend=layer.backend)

    def write(self, ids: Tensor, value: Tensor, keep: Tensor | None,  # value: (n, d) fp32; keep: (n, 1) | () bool
              group: Tensor) -> None:  # group: (n,) int64, equal for equal ids
        layer, fake = self.layer, is_fake(value)
        noise = random_halfwords(value.shape, None if fake else self.generator(value.device), device=value.device,
                                 fake=fake)[group]
        codes, scales = quantize(value, layer.block, stochastic=True, noise=noise)
        if keep is not None:
            codes = torch.where(keep, layer.weight_codes[ids], codes)
            scales = torch.where(keep, layer.weight_scales[ids], scales)
        layer.weight_codes.index_copy_(0, ids, codes)
        layer.weight_scales.index_copy_(0, ids, scales)


def plain_embedding_error(module: nn.Module | None, what: str) -> str | None:
    """Why ``module`` (the model's input embedding or LM head) cannot be stored in INT8, or None."""
    if what == "input embedding":
        if type(module) is not nn.Embedding:
            return f"the input embedding is {type(module).__name__}, not a plain nn.Embedding"
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            return "the input embedding uses max_norm, scale_grad_by_freq or sparse gradients"
    elif type(module) is not nn.Linear:
        return f"the LM head is {type(module).__name__}, not a plain nn.Linear"
    return None


def quantize_vocab(model: nn.Module, *, block: int = BLOCK, backend: str | None = None,
                   device: torch.device | None = None, materialize: Materialize | None = None) -> int:
    """Store ``model``'s input embedding and LM head (``get_input_embeddings`` / ``get_output_embeddings``) as
    INT8 (``Int8Embedding`` / ``Int8Linear``); returns how many were converted (converted ones are left as they
    are). ValueError, naming the reason, for tied embeddings or a module that is not a plain one. ``device``: each
    table is quantized there, ``materialize`` first makes it (``quantize_linears``)."""
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and not isinstance(head, Int8Linear) and head.weight is getattr(emb, "weight", None):
        raise ValueError("method.embedding_dtype=int8: the input embedding and the LM head are tied (one matrix); "
                         "set method.embedding_dtype=bf16")
    converted = 0
    if not isinstance(emb, Int8Embedding):
        why = plain_embedding_error(emb, "input embedding")
        if why:
            raise ValueError(f"method.embedding_dtype=int8: {why}")
        if materialize is not None:
            materialize(emb)
        model.set_input_embeddings(Int8Embedding.from_module(emb, block=block, backend=backend, device=device))
        converted += 1
    if head is not None and not isinstance(head, Int8Linear):
        why = plain_embedding_error(head, "LM head")
        if why:
            raise ValueError(f"method.embedding_dtype=int8: {why}")
        if materialize is not None:
            materialize(head)
        model.set_output_embeddings(Int8Linear.from_module(head, block=block, backend=backend, device=device))
        converted += 1
    return converted
