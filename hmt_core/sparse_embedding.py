"""Row-sparse embedding updates for HMT (``method.embedding_update=lazy_exact|sparse_adam``): the input embedding's
gradient never exists as a (V, d) tensor. Its lookup runs through an autograd function whose backward hands the
output gradient (N, d) and the token ids (N,) to HMT's per-layer engine, which forms the touched rows' gradient by
segment sums (``hmt_core.optim.row_adam.segment_rows``) and updates those rows inside backward (or in
``finish_step`` when clipping defers it, with the same coefficient as every other parameter). The update rules and
their math: ``hmt_core.optim.row_adam``; design and measurements: docs/embedding_memory.md.

The weight keeps a real gradient edge (``requires_grad``) but receives no ``.grad``: the backward returns None for it.
``lazy_exact`` brings the looked-up rows up to date in the forward (the state dense AdamW would have after the last
step), so a forward reads what the dense run reads. Multi-process (``reduce_grad.rows``): every rank's (ids, rows)
are all-gathered — the rows travel as rows — and every rank sums them in the same order.

The INT8 embedding (``method.embedding_dtype=int8``, ``Int8Embedding``) takes the same path through its ``Int8Rows``:
the lookup dequantizes the rows (``lazy_exact``: caught up in fp32 without being stored), and the step dequantizes
each touched row once, catches it up, steps it and requantizes it by stochastic rounding. With ``method.dense_8bit``
the moments are 8-bit (``RowAdamState(eight_bit=True)``) for either table.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hmt_core.int8_weights.codec import dequantize
from hmt_core.int8_weights.embedding import Int8Embedding, Int8Rows
from hmt_core.optim.optimizer import LowRankOptimizer, Slot
from hmt_core.optim.row_adam import RowAdamConfig, RowAdamState, TensorRows, segment_rows


class _RowSparseLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, module: nn.Embedding) -> Tensor:  # ids: (...); -> (..., d)
        ctx.save_for_backward(ids)
        ctx.module = module
        return module.rows_update.lookup(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[None, None, None]:  # grad_out: (..., d)
        (ids,) = ctx.saved_tensors
        ctx.module.rows_update.on_grad(ids, grad_out)
        return None, None, None


class RowSparseEmbedding(nn.Embedding):
    """An ``nn.Embedding`` (same parameter, same state-dict keys) whose lookup feeds ``rows_update``."""

    rows_update: SparseEmbeddingUpdate

    def forward(self, input: Tensor) -> Tensor:
        return _RowSparseLookup.apply(input, self.weight, self)


class Int8RowSparseEmbedding(Int8Embedding):
    """An ``Int8Embedding`` (same codes, scales and state-dict keys) whose lookup feeds ``rows_update``."""

    rows_update: SparseEmbeddingUpdate

    def forward(self, input: Tensor) -> Tensor:
        return _RowSparseLookup.apply(input, self.weight, self)


class SparseEmbeddingUpdate:
    """The embedding slot's row-sparse AdamW, driven by the per-layer engine's micro-batch index, clipping rule,
    non-finite flag and reducer."""

    def __init__(self, opt: LowRankOptimizer, slot: Slot, engine: Any, cfg: RowAdamConfig,
                 module: nn.Embedding) -> None:
        self.opt, self.slot, self.engine, self.padding_idx = opt, slot, engine, module.padding_idx
        w = slot.param
        self.int8 = module if isinstance(module, Int8Embedding) else None
        self.rows = Int8Rows(module, opt.writer.rounding_generator) if self.int8 is not None else None
        self.state = RowAdamState(cfg, tuple(w.shape), dtype=opt.dense_state_dtype or (
            torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32), device=w.device,
            eight_bit=opt.rule.dense_8bit)
        opt.dense8.pop(slot.name, None)  # dense_8bit: the 8-bit row moments replace bitsandbytes' for this weight
        slot.m, slot.v = self.state.m, self.state.v  # counted and saved with the other slots' moments
        self.pending: list[tuple[Tensor, Tensor]] = []  # lookups' (ids (N,), output gradient (N, d)) of the step
        self._pass_start = 0  # where the running backward pass's lookups begin in ``pending``
        self._queued = False  # ``_end_of_backward`` is queued on the running backward

    def weight_rows(self) -> Int8Rows | TensorRows:
        return self.rows if self.rows is not None else TensorRows(self.slot.param.data)

    @torch.no_grad()
    def lookup(self, ids: Tensor, weight: Tensor) -> Tensor:  # ids: (...) -> (..., d) weight.dtype
        """The forward's rows, as dense AdamW has them (``lazy_exact``: rows caught up first; a BF16 table stores
        them, the INT8 one computes them in fp32 and leaves the write to the step)."""
        if self.int8 is None:
            self.state.catch_up_(self.slot.param.data, ids.reshape(-1), self.slot.clock.adam_t + 1)
            return F.embedding(ids, weight, self.padding_idx)
        layer, flat = self.int8, ids.reshape(-1)
        if self.state.last is None:  # sparse_adam: the stored rows are current
            rows = dequantize(layer.weight_codes[flat], layer.weight_scales[flat], layer.block, weight.dtype,
                              backend=layer.backend)
        else:
            rows = self.state.caught_up(self.rows, flat, self.slot.clock.adam_t + 1).to(weight.dtype)
        return rows.view(*ids.shape, rows.shape[-1])

    @torch.no_grad()
    def on_grad(self, ids: Tensor, grad: Tensor) -> None:  # ids: (...); grad: (..., d)
        """One lookup's output gradient: kept (and, multi-process, gathered) until the backward pass ends — a model
        may look up the embedding more than once per backward, like ``AccumulateGrad`` sums several uses."""
        eng = self.engine
        if eng.nonfinite:
            return
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if self.padding_idx is not None:  # nn.Embedding's padding row gets no gradient
            grad = torch.where((ids == self.padding_idx)[:, None], 0.0, grad)
        if eng.reduce_grad is not None:
            ids, grad = eng.reduce_grad.rows(ids, grad)  # every rank's, in rank order
        self.pending.append((ids, grad))
        if not self._queued and torch._C._current_graph_task_id() != -1:  # inside an autograd backward
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        elif not self._queued:
            self._end_of_backward()

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        """On the last micro-batch: the rows' gradient (segment sums of every lookup and micro-batch), its norm for
        the global one, and the update (now, or in ``finish_step`` when clipping defers it)."""
        self._queued = False
        eng = self.engine
        # autograd runs a pass's later lookups first: put them back in forward order, so that a row's tokens are
        # summed in the order of the batch (a multi-process step sums rank 0's tokens, then rank 1's: the same)
        self.pending[self._pass_start:] = self.pending[self._pass_start:][::-1]
        self._pass_start = len(self.pending)
        if eng.nonfinite or eng.index != eng.count - 1 or not self.pending:
            return
        ids, grad = (torch.cat(x) for x in zip(*self.pending)) if len(self.pending) > 1 else self.pending[0]
        self.pending, self._pass_start = [], 0
        ids_sorted, rows, sums = segment_rows(ids, grad)
        if eng.reduce_grad is not None:
            rows, sums = rows.div_(eng.reduce_grad.world_size), sums.div_(eng.reduce_grad.world_size)
        norm = torch.linalg.vector_norm(sums)
        eng.norms[self.slot.index] = norm
        if eng.clipping:
            eng.deferred_rows.append(lambda coef: self.apply(ids_sorted, rows, coef))
            return
        with self.opt.skipping(eng._flag(norm)):
            self.apply(ids_sorted, rows, None)

    def apply(self, ids_sorted: Tensor, rows: Tensor, coef: Tensor | None) -> None:  # (N,), (N, d) fp32
        s = self.slot
        s.clock.step += 1
        s.clock.adam_t += 1
        self.opt.skip.count(s.clock)
        self.state.step_rows_(self.weight_rows(), ids_sorted, rows if coef is None else rows * coef, s.clock.adam_t,
                              self.opt.lr_of(s), skip=self.opt.skip.flag)

    @torch.no_grad()
    def materialize(self) -> None:
        """lazy_exact: every row brought up to date (what dense AdamW's weight is now), e.g. before the weights are
        exported; the training trajectory does not change (a later catch-up starts from here)."""
        rows = torch.arange(self.slot.param.shape[0], device=self.slot.param.device)
        self.state.catch_up_(self.weight_rows(), rows, self.slot.clock.adam_t + 1)

    def discard(self) -> None:
        self.pending, self._pass_start = [], 0


def install(model: nn.Module, opt: LowRankOptimizer, engine: Any, cfg: RowAdamConfig) -> SparseEmbeddingUpdate:
    """Make the model's input embedding row-sparse; a ValueError (one line) for an embedding it cannot take."""
    key = f"method.embedding_update={cfg.variant}"
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"{key} needs an nn.Embedding input embedding, got {type(emb).__name__}")
    if emb.max_norm is not None or emb.sparse:
        raise ValueError(f"{key}: the embedding has max_norm or sparse=True, which the row update does not follow")
    shared = [n for n, m in model.named_modules() if m is not emb and getattr(m, "weight", None) is emb.weight]
    if shared:
        raise ValueError(f"{key}: the input embedding is tied to {shared[0]} (its gradient is dense); "
                         "use method.embedding_update=dense")
    param = emb.handle if isinstance(emb, Int8Embedding) else emb.weight  # an INT8 table: its optimizer handle
    slot = next((s for s in opt.slots if s.param is param), None)
    if slot is None or slot.projected:
        raise ValueError(f"{key}: the input embedding is not a trainable dense parameter of this optimizer")
    update = SparseEmbeddingUpdate(opt, slot, engine, cfg, emb)
    emb.__class__ = Int8RowSparseEmbedding if isinstance(emb, Int8Embedding) else RowSparseEmbedding
    emb.rows_update = update
    return update
