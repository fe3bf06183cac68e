"""AdamW on the rows of an embedding that a batch touched: the row-sparse gradient (segment sums over the batch's
token ids, no (V, d) buffer) and two update rules, as functions over tensors plus the per-row clock they need.

- ``sparse_adam``: ``torch.optim.SparseAdam``'s semantics — the moments and the weight of a row change only in a
  step that touches it; bias correction by the global step (decoupled weight decay, if any, on touched rows only).
- ``lazy_exact``: dense AdamW (every row moves every step, zero gradient for untouched rows) evaluated lazily. A row
  keeps ``last``, the step its state is current at; before it is read (the embedding's forward) or updated, the k
  zero-gradient steps it missed are applied in closed form (docs/embedding_memory.md, "Row-sparse embedding updates"):

      m ← β₁ᵏ m,  v ← β₂ᵏ v                                        (exact)
      W ← D W − Σ_{j=1..k} δ_j s_τ β₁ʲ m / (a_j (√v + ε/a₁)),  τ = last + j,  a_j = β₂^{j/2} b_τ

  with D = Π (1 − η_τ λ) over the k steps (exact for any lr schedule; a float64 log-prefix table), δ_j the decay of
  the later missed steps, s_τ / b_τ the style's step size / √-bias factor (torch: η/(1−β₁^τ), 1/√(1−β₂^τ); hf:
  η√(1−β₂^τ)/(1−β₁^τ), 1). Only ε is treated approximately: the true denominator a_j √v + ε is replaced by
  a_j √v + ε ρ_j with ρ_j = a_j/a₁ ≤ 1, which makes every term a per-row scalar times m/(√v + ε/a₁). Per element and
  missed step the error is ≤ |term_j| (1 − ρ_j) min(1, ε/(a_j √v)): 0 for j = 1, and the sum over j converges
  like (β₁/√β₂)ʲ. The sum stops after ``window`` terms (default 256: (β₁/√β₂)^256 ≈ 2e-12 at the defaults).

No host synchronization: ``torch.sort`` and a cumulative sum give each position its row's segment (fixed size N),
every position computes its row's result (a row's duplicates compute identical values) and ``index_copy_`` writes
them back (duplicates write the same value).

The weight is anything with ``read(ids) -> (n, d) fp32`` and ``write(ids, value, keep, group)`` (``TensorRows`` for
a plain tensor; the INT8 embedding's codes and scales, ``hmt_core.int8_weights.embedding.Int8Rows``, requantized by
stochastic rounding with one draw per distinct row: ``group``). A step reads each row once, catches it up and steps
it in fp32, and writes it once. The moments are (V, d) tensors in ``dtype``, or 8-bit (``eight_bit``: the block-wise
dynamic-map codes of ``hmt_core.optim.moments8``, one fp32 absmax per 256 elements of a row, so rows are read and
written on their own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from typing import Protocol

from hmt_core.adam import adam_moments_, adam_step, apply_update_
from hmt_core.int8_weights.codec import BLOCK
from hmt_core.optim.moments8 import decode, dynamic_map, encode

VARIANTS = ("dense", "lazy_exact", "sparse_adam")


@dataclass(frozen=True, kw_only=True)
class RowAdamConfig:
    variant: str  # "lazy_exact" | "sparse_adam"
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    style: str  # "torch" | "hf" (hmt_core.adam)
    window: int = 256  # lazy_exact: missed steps summed per catch-up (later ones are below fp32 rounding)


def segment_rows(ids: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # ids: (N,) int; grad: (N, d)
    """(sorted ids (N,), each position's row total (N, d) fp32, the segment sums (N, d) fp32 with one row per distinct
    id and zero rows after them): the embedding gradient's non-zero rows, without a (V, d) buffer or a host read."""
    ids_sorted, perm = torch.sort(ids.reshape(-1), stable=True)
    first = torch.ones_like(ids_sorted, dtype=torch.bool)
    first[1:] = ids_sorted[1:] != ids_sorted[:-1]
    seg = torch.cumsum(first, 0) - 1  # (N,) segment of each sorted position
    sums = torch.zeros(grad.shape[0], grad.shape[-1], dtype=torch.float32, device=grad.device)
    sums.index_add_(0, seg, grad.reshape(-1, grad.shape[-1])[perm].float())
    return ids_sorted, sums[seg], sums


class Rows(Protocol):
    """A (V, d) weight as the row rules see it: fp32 rows in, fp32 rows out."""

    shape: tuple[int, ...]

    def read(self, ids: Tensor) -> Tensor: ...  # ids: (n,) -> (n, d) fp32

    def write(self, ids: Tensor, value: Tensor, keep: Tensor | None, group: Tensor) -> None: ...


class TensorRows:
    """A plain weight tensor (V, d): rows gathered as fp32, written back round-to-nearest in its dtype. ``keep``
    ((n, 1) or () bool): where True the stored row stays; ``group`` (each position's distinct row) is not needed."""

    def __init__(self, weight: Tensor) -> None:
        self.weight, self.shape = weight, tuple(weight.shape)

    def read(self, ids: Tensor) -> Tensor:
        return self.weight[ids].float()

    def write(self, ids: Tensor, value: Tensor, keep: Tensor | None, group: Tensor) -> None:
        if keep is not None:
            value = torch.where(keep, self.weight[ids].float(), value)
        self.weight.index_copy_(0, ids, value.to(self.weight.dtype))


def as_rows(weight: Tensor | Rows) -> Rows:
    return TensorRows(weight) if isinstance(weight, Tensor) else weight


class RowAdamState:
    """Moments (V, d) (dense in ``dtype``, or 8-bit codes + block absmax), the per-row clock ``last`` (V,) and the
    step tables of one embedding's row-sparse AdamW."""

    def __init__(self, cfg: RowAdamConfig, shape: tuple[int, int], *, dtype: torch.dtype,
                 device: torch.device, eight_bit: bool = False) -> None:
        self.cfg = cfg
        self.m = torch.zeros(shape, dtype=torch.uint8 if eight_bit else dtype, device=device)
        self.v = torch.zeros(shape, dtype=torch.uint8 if eight_bit else dtype, device=device)
        blocks = (shape[0], -(-shape[1] // BLOCK))
        self.m_absmax = torch.zeros(blocks, device=device) if eight_bit else None  # zero: x̂ = 0
        self.v_absmax = torch.zeros(blocks, device=device) if eight_bit else None
        self.maps = (dynamic_map(True).to(device), dynamic_map(False).to(device)) if eight_bit else None
        self.bounds = tuple((x[1:] + x[:-1]) / 2 for x in self.maps) if eight_bit else None  # nearest = bucketize
        lazy = cfg.variant == "lazy_exact"
        self.last = torch.zeros(shape[0], dtype=torch.int64, device=device) if lazy else None  # step current at
        # lazy_exact, index = step t (1-based; entry 0 unused): the lr of step t, Σ_{τ≤t} log(1 − η_τ λ)
        self.lr_table = torch.zeros(64, dtype=torch.float64, device=device) if lazy else None
        self.log_decay = torch.zeros(64, dtype=torch.float64, device=device) if lazy else None

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.m, self.v, self.m_absmax, self.v_absmax, self.last, self.lr_table, self.log_decay)
                if t is not None]

    def moments(self, ids: Tensor) -> tuple[Tensor, Tensor]:  # ids: (n,) -> (m, v) (n, d) fp32, fresh
        if self.maps is None:
            return self.m[ids].float(), self.v[ids].float()
        return (decode(self.m[ids], self.m_absmax[ids], self.maps[0], BLOCK),
                decode(self.v[ids], self.v_absmax[ids], self.maps[1], BLOCK))

    def _store_moments(self, ids: Tensor, m: Tensor, v: Tensor, keep: Tensor | None) -> None:
        """Rows ``ids`` of the moments ← fp32 (m, v) (8-bit: round-to-nearest on the maps); ``keep`` ((n, 1) or ()
        bool): where True the stored rows stay."""
        if self.maps is None:
            for mine, new in ((self.m, m), (self.v, v)):
                new = new if keep is None else torch.where(keep, mine[ids].float(), new)
                mine.index_copy_(0, ids, new.to(mine.dtype))
            return
        for mine, absmax, bounds, new in ((self.m, self.m_absmax, self.bounds[0], m),
                                          (self.v, self.v_absmax, self.bounds[1], v)):
            codes, scale = encode(new, bounds, BLOCK)
            if keep is not None:
                codes, scale = torch.where(keep, mine[ids], codes), torch.where(keep, absmax[ids], scale)
            mine.index_copy_(0, ids, codes)
            absmax.index_copy_(0, ids, scale)

    def record_step(self, t: int, lr: float) -> None:
        """Step ``t``'s lr into the tables (a fill kernel and a device add: no host read)."""
        if self.lr_table is None:
            return
        if t >= self.lr_table.numel():  # double the capacity (host-side size: no synchronization)
            grow = lambda x: torch.cat([x, torch.zeros_like(x)])  # noqa: E731
            self.lr_table, self.log_decay = grow(self.lr_table), grow(self.log_decay)
        self.lr_table[t].fill_(lr)
        torch.add(self.log_decay[t - 1], math.log1p(-lr * self.cfg.weight_decay), out=self.log_decay[t])

    def _coefficients(self, t0: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # t0: (N,) int64
        """Per row, for its missed steps (t0, t−1]: (D (N,), S (N,), coef (N, J), a (N, J)), float64:
        W ← D W − S m/(√v + ε/a₁) with S = Σ_j coef_j."""
        c = self.cfg
        j = torch.arange(1, c.window + 1, device=t0.device, dtype=torch.int64)  # (J,)
        k = (t - 1 - t0).clamp(min=0)  # (N,) missed steps
        tau = (t0[:, None] + j).clamp(max=max(t - 1, 1))  # (N, J)
        valid = j <= k[:, None]
        lr = self.lr_table[tau]
        bc1, bc2 = 1 - c.beta1 ** tau.double(), 1 - c.beta2 ** tau.double()
        step, b = (lr / bc1, bc2.rsqrt()) if c.style == "torch" else (lr * bc2.sqrt() / bc1, torch.ones_like(bc2))
        jd = j.double()
        a = c.beta2 ** (jd / 2) * b  # (N, J)
        end = self.log_decay[torch.full_like(t0, max(t - 1, 0))]  # (N,)
        after = self.log_decay[tau if c.style == "torch" else tau - 1]  # decay of the missed steps after τ (hf: τ on)
        coef = torch.where(valid, step * c.beta1 ** jd / a * torch.exp(end[:, None] - after), 0.0)
        decay = torch.exp(end - self.log_decay[t0.clamp(max=max(t - 1, 0))])
        return decay, coef.sum(1), coef, a

    def _chunks(self, n: int, d: int) -> list[tuple[int, int]]:  # (start, end) positions: bounded temporaries
        rows = max(1, min(2**22 // max(d, 1), 2**16 // self.cfg.window))  # ≤ 16 MiB fp32 rows, ≤ 0.5 MiB tables
        return [(a, min(a + rows, n)) for a in range(0, n, rows)]

    def catch_up_(self, weight: Tensor | Rows, ids: Tensor, t: int) -> None:  # weight: (V, d); ids: (N,)
        """lazy_exact: rows ``ids`` brought to the state dense AdamW has after step t − 1 and stored (no-op for
        current rows; a row repeated in a later chunk is current by then). A weight that rounds stochastically
        (``Int8Rows``) needs distinct ``ids`` here (each position draws its own noise)."""
        if self.last is None or t <= 1:
            return
        weight, ids = as_rows(weight), ids.reshape(-1)
        for a, b in self._chunks(ids.numel(), weight.shape[1]):
            n = ids[a:b]
            t0 = self.last[n]
            m, v = self.moments(n)
            w = weight.read(n)
            self._catch_up_math(w, m, v, t0, t)
            self._store_moments(n, m, v, None)
            weight.write(n, w, None, torch.arange(b - a, device=ids.device))
            self.last.index_copy_(0, n, torch.maximum(t0, torch.full_like(t0, t - 1)))

    def caught_up(self, weight: Rows, ids: Tensor, t: int) -> Tensor:  # ids: (N,) -> (N, d) fp32
        """The rows ``ids`` as dense AdamW has them after step t − 1, computed without storing them (the INT8
        embedding's lookup: the row is written once, by the step that follows)."""
        ids = ids.reshape(-1)
        if self.last is None or t <= 1:
            return weight.read(ids)
        out = []
        for a, b in self._chunks(ids.numel(), weight.shape[1]):
            w = weight.read(ids[a:b])
            self._catch_up_math(w, *self.moments(ids[a:b]), self.last[ids[a:b]], t)
            out.append(w)
        return out[0] if len(out) == 1 else torch.cat(out)

    def _catch_up_math(self, w: Tensor, m: Tensor, v: Tensor, t0: Tensor, t: int) -> None:  # (n, d) fp32, in place
        """The closed-form catch-up of rows last current at ``t0`` (n,) to step t − 1 (identity where t0 ≥ t − 1)."""
        decay, s, _, a = self._coefficients(t0, t)
        k = (t - 1 - t0).clamp(min=0).double()
        w.mul_(decay[:, None].float()).sub_(s[:, None].float() * m / (v.sqrt() + (self.cfg.eps / a[:, :1]).float()))
        m.mul_((self.cfg.beta1 ** k)[:, None].float())
        v.mul_((self.cfg.beta2 ** k)[:, None].float())

    def catch_up_bound(self, ids: Tensor, t: int) -> Tensor:  # ids: (N,) -> (N, d) float64
        """The ε-error bound of ``catch_up_`` for rows ``ids`` at step t (before it runs), per element:
        Σ_j |term_j| (1 − ρ_j) min(1, ε/(a_j √v)) (module docstring). A diagnostic: O(N · window · d) memory."""
        _, _, coef, a = self._coefficients(self.last[ids], t)  # (N, J)
        m, v = self.moments(ids)
        x = v.double().sqrt()[:, None, :]  # (N, 1, d)
        term = coef[:, :, None] * m.double().abs()[:, None, :] / (x + (self.cfg.eps / a[:, :1])[:, :, None])
        rho = (a / a[:, :1])[:, :, None]
        share = torch.clamp(self.cfg.eps / (a[:, :, None] * x), max=1.0)  # (N, J, d); √v = 0: 1
        return (term * (1 - rho) * share).sum(1)

    def step_rows_(self, weight: Tensor | Rows, ids: Tensor, rows: Tensor, t: int, lr: float,  # weight: (V, d)
                   skip: Tensor | None = None) -> None:  # ids: (N,) sorted; rows: (N, d) fp32 row totals
        """Step t on the touched rows: each row read once, caught up (lazy_exact; the identity for a row the
        forward already brought up to date), AdamW's arithmetic of the dense path (``hmt_core.adam``), written
        once; in chunks of positions. ``skip`` (() bool): where True, nothing changes. A row whose run of equal
        ids began in an earlier chunk rewrites its (already updated) values."""
        self.record_step(t, lr)
        weight = as_rows(weight)
        pos = torch.arange(ids.numel(), device=ids.device)
        first = torch.ones_like(ids, dtype=torch.bool)
        first[1:] = ids[1:] != ids[:-1]
        start = torch.cummax(torch.where(first, pos, 0), 0).values  # (N,) where each position's run of ids begins
        for a, b in self._chunks(ids.numel(), weight.shape[1]):
            keep = start[a:b] < a  # (n,) updated by an earlier chunk
            group = (torch.cumsum(first[a:b], 0) - 1).clamp_(min=0)  # (n,) the chunk's distinct row of a position
            self._step_chunk(weight, ids[a:b], rows[a:b], t, lr, keep if skip is None else keep | skip, group)

    def _step_chunk(self, weight: Rows, ids: Tensor, rows: Tensor, t: int, lr: float, keep: Tensor,
                    group: Tensor) -> None:  # ids: (n,); rows: (n, d) fp32; keep: (n,) or () bool
        c = self.cfg
        m, v = self.moments(ids)
        w = weight.read(ids)
        if self.last is not None:
            self._catch_up_math(w, m, v, self.last[ids], t)
        adam_moments_(m, v, rows, c.beta1, c.beta2, c.style)
        d, step_size = adam_step(m, v, t, lr=lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps, style=c.style)
        apply_update_(w, d, step_size=step_size, lr=lr, weight_decay=c.weight_decay, style=c.style)
        kept = keep[:, None] if keep.dim() else keep
        self._store_moments(ids, m, v, kept)
        weight.write(ids, w, kept, group)
        if self.last is not None:
            self.last.index_copy_(0, ids, torch.where(keep, self.last[ids], torch.full_like(ids, t)))

    def state_dict(self) -> dict[str, Tensor | None]:
        return {"m": self.m, "v": self.v, "m_absmax": self.m_absmax, "v_absmax": self.v_absmax, "last": self.last,
                "lr_table": self.lr_table, "log_decay": self.log_decay}

    def load_state_dict(self, state: dict[str, Tensor | None]) -> None:
        for key, value in state.items():
            if value is not None and getattr(self, key) is not None:
                setattr(self, key, value.detach().clone().to(getattr(self, key).device))
