"""Update precision for low-precision weights (BF16, and INT8 codes): fp32 master weights (Micikevicius et al.,
2018, "Mixed Precision Training", §3.1) and stochastic rounding (Gupta et al., 2015, Eq. 2: x stored as ⌈x⌉ with
probability (x − ⌊x⌋)/ε, so E[SR(x)] = x; Q-GaLore, Zhang et al., 2024, §3.3, for INT8 codes).

``stochastic_round`` rounds to BF16 (bit arithmetic on the fp32 pattern), ``stochastic_round_int`` onto the integer
grid of INT8 codes, both with bits from one seeded generator (``random_bits``). ``UpdateWriter`` routes an
optimizer's fp32 update to the weight: in place, into an fp32 master, or through fp32 row chunks rounded
stochastically (also into a ``QuantizedWeight``). Why BF16 loses small updates: docs/design/hmt_core_notes.md."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hmt_core.kernels.chunks import (  # noqa: F401  (re-exported: the row-chunk rule of every chunked update)
    CHUNK_BYTES, CUDA_CHUNK_BYTES, chunk_budget, chunk_rows_for)

_LOW_BITS = 1 << 16  # BF16 is the upper 16 bits of the fp32 pattern: 16 bits are rounded away
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as int32


def random_bits(shape: tuple[int, ...] | torch.Size, bits: int, generator: torch.Generator | None, *,
                device: torch.device, fake: bool = False) -> Tensor:  # -> shape, int32 in [0, 2**bits)
    """Uniform ``bits``-bit integers from ``generator`` (on ``device``). ``fake`` (dry run): an uninitialized int32
    tensor of the same shape — the same bytes, no random draws."""
    if fake:
        return torch.empty(shape, dtype=torch.int32, device=device)
    return torch.randint(0, 1 << bits, shape, generator=generator, dtype=torch.int32, device=device)


def stochastic_round(x: Tensor, generator: torch.Generator | None,  # x: any shape, fp32
                     dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """x rounded to BF16 stochastically: add a uniform 16-bit integer u ∈ [0, 2¹⁶) to the fp32 bit pattern and
    truncate the lower 16 bits. With f = the truncated bits (the distance to ⌊x⌋ in units of 2⁻¹⁶ ε), the carry
    into bit 16 happens iff u ≥ 2¹⁶ − f, with probability f/2¹⁶ = (x − ⌊x⌋)/ε: unbiased, and exact values (f = 0)
    never move. Works on the magnitude (sign-magnitude format), so it is symmetric for negative x; ±inf stay, NaN
    stays NaN; a carry out of the largest finite value gives inf, as a rounding up should. ``generator`` must be on
    x's device; fake (dry-run) tensors take no random draws. Returns a new tensor of ``dtype``."""
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic_round supports bfloat16 targets, got {dtype}")
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round rounds fp32 values, got {x.dtype}")
    noise = random_bits(x.shape, 16, generator, device=x.device, fake=is_fake(x))
    bits = noise.add_(x.contiguous().view(torch.int32)).bitwise_and_(_HIGH_MASK)
    out = bits.view(torch.float32).to(dtype)  # the lower 16 bits are zero: the conversion is exact
    return out.masked_fill_(torch.isnan(x), float("nan"))


def random_halfwords(shape: tuple[int, ...] | torch.Size, generator: torch.Generator | None, *,
                     device: torch.device, fake: bool = False) -> Tensor:  # -> shape, int16
    """Uniform signed 16-bit integers (all 2¹⁶ values equally likely), two per 32-bit draw of ``generator``: half the
    generator's work of one draw per element. ``fake``: the same ops without draws (same bytes)."""
    n = int(torch.Size(shape).numel())
    words = ((n + 1) // 2,)
    if fake:
        raw = torch.empty(words, dtype=torch.int32, device=device)
    else:
        raw = torch.randint(-(1 << 31), 1 << 31, words, generator=generator, dtype=torch.int32, device=device)
    return raw.view(torch.int16)[:n].view(shape)


def stochastic_round_int(y: Tensor, generator: torch.Generator | None,  # y: any shape, fp32, |y| < 2²³
                         noise: Tensor | None = None) -> Tensor:
    """y rounded to an integer stochastically (Gupta et al., 2015, Eq. 2, with ε = 1): ⌊y⌋ + 1 with probability
    f = y − ⌊y⌋, else ⌊y⌋, so E[SR(y)] = y and Var = f(1 − f) ≤ 1/4; integers never move. f is exact in fp32 for
    |y| < 2²³. The draw: up iff u < f·2¹⁶ − 2¹⁵ for u uniform over the 2¹⁶ signed 16-bit integers, so
    P(up) = ⌈f·2¹⁶⌉/2¹⁶ up to one fp32 rounding of the threshold: |P(up) − f| < 2⁻¹⁵, a bias below 2⁻¹⁵ of a unit.
    Returns fp32 integer values (the caller clamps and casts); a fake y takes no draws. ``noise``: the uniform
    halfwords (int16, y's shape) drawn beforehand with ``random_halfwords`` (a fused kernel's input), else drawn
    here from ``generator``."""
    if y.dtype != torch.float32:
        raise ValueError(f"stochastic_round_int rounds fp32 values, got {y.dtype}")
    low = torch.floor(y)
    threshold = torch.sub(y, low).mul_(65536.0).sub_(32768.0)  # f·2¹⁶ − 2¹⁵
    if noise is None:
        noise = random_halfwords(y.shape, generator, device=y.device, fake=is_fake(y))
    up = noise < threshold
    return low.add_(up)


@runtime_checkable
class QuantizedWeight(Protocol):
    """A weight stored in a format an update cannot be applied to in place (``hmt_core.int8_weights``): the writer
    reads rows as fp32, the optimizer updates them, and the weight stores them back by stochastic rounding."""

    shape: torch.Size

    def read_rows(self, index: Any) -> Tensor:  # -> (rows, cols) fp32
        ...

    def write_rows(self, index: Any, value: Tensor, generator: torch.Generator | None,  # value: fp32
                   keep: Tensor | None = None) -> None:  # keep: () bool, True: the stored rows stay as they are
        ...

    def fuses_update(self, update: Tensor) -> bool:  # whether ``update_rows`` runs one fused kernel for it
        ...

    def stored_tensors(self) -> tuple[Tensor, ...]:  # the tensors holding its values (codes, scales)
        ...

    def exported(self, *stored: Tensor) -> Tensor:  # the weight a state dict exports, from copies of stored_tensors
        ...

    def update_rows(self, index: Any, update: Tensor, *, step_size: float, decay: float, decay_after: bool,
                    generator: torch.Generator | None,
                    keep: Tensor | None = None) -> None:  # update: (rows, cols) fp32; keep: () bool
        ...


_QUANTIZED_TYPES: dict[type, bool] = {}


def is_quantized(param: Any) -> bool:
    """``isinstance(param, QuantizedWeight)``, decided once per type: a runtime protocol check inspects every member
    (~20 µs), and the optimizer asks per weight write, ~150 times per step of a small model (3 ms of a 40 ms CPU
    step). Every instance of a type has the protocol's members (methods on the class, ``shape`` on every tensor)."""
    kind = type(param)
    found = _QUANTIZED_TYPES.get(kind)
    if found is None:
        found = _QUANTIZED_TYPES[kind] = isinstance(param, QuantizedWeight)
    return found


def write_rows(shape: tuple[int, ...], chunk_bytes: int | None = None, *, like: Any = None) -> list[Any]:
    """Row spans (indices) of a weight of ``shape`` such that one fp32 row chunk holds ≤ ``chunk_bytes`` (default
    ``chunk_budget(like)``); 0-d and 1-d weights are one span (``...``)."""
    if len(shape) < 2:
        return [...]
    rows = chunk_rows_for(shape, torch.float32, chunk_bytes or 0, like=like)
    if rows >= shape[0]:
        return [...]
    return [slice(a, min(a + rows, shape[0])) for a in range(0, shape[0], rows)]


# A probe sees every write routed through an fp32 value: (the parameter, the row index, the fp32 update that the
# optimizer computed for those rows, i.e. fp32 value after − before). Benchmarks use it to measure lost updates.
Probe = Callable[[Tensor, Any, Tensor], None]


class UpdateWriter:
    """Routes an optimizer's update to a weight: in place (the default: the update is applied to the weight in its
    own dtype), into the weight's fp32 master copy (then copied into the weight, round-to-nearest), or into an fp32
    temporary of some rows that is then rounded stochastically into the weight. A ``QuantizedWeight`` (INT8 codes)
    is always written through fp32 row chunks and stochastic rounding, whatever the flags (they apply to the
    ordinary weights beside it).

    The optimizer applies its update (pure functions, in place) to what ``rows`` yields; the write-back happens when
    the ``with`` block ends. Owns the random generator of stochastic rounding (seeded with ``seed``, created on
    first use on the weights' device) and its state (``state_dict``), so a resumed run draws the same bits.
    """

    def __init__(self, *, master_weights: bool = False, stochastic_rounding: bool = False, seed: int = 0) -> None:
        if master_weights and stochastic_rounding:
            raise ValueError("method.master_weights and method.stochastic_rounding are alternatives: choose one "
                             "(stochastic rounding is for BF16 weights without an fp32 copy)")
        self.master_weights = master_weights
        self.stochastic = stochastic_rounding
        self.seed = seed
        self.generator: torch.Generator | None = None
        self._saved_state: Tensor | None = None  # loaded before the generator existed
        self.probe: Probe | None = None

    @property
    def plain(self) -> bool:
        return not (self.master_weights or self.stochastic)

    def check(self, name: str, param: Tensor) -> None:
        """ValueError when stochastic rounding is asked for a weight it cannot round (only BF16 and fp32)."""
        if self.stochastic and param.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"method.stochastic_rounding=true rounds to bfloat16, but {name} is {param.dtype}")

    def make_master(self, param: Tensor) -> Tensor | None:
        """The fp32 master copy of a low-precision ``param`` (None when not using masters, or already fp32)."""
        if not self.master_weights or param.dtype == torch.float32 or not param.is_floating_point():
            return None
        return param.detach().float().clone()

    def spans(self, param: Tensor, master: Tensor | None, *, like: Tensor | None = None) -> list[Any]:
        """Row indices to write ``param`` in: one span unless the write goes through fp32 temporaries (chunks of
        ``chunk_budget(like)``: ``like`` a tensor on the weight's device, e.g. its update; a quantized weight has
        no tensor of its own)."""
        if is_quantized(param):
            return write_rows(tuple(param.shape), like=like)
        if master is None and param.dtype != torch.float32 and (self.stochastic or self.probe is not None):
            return write_rows(tuple(param.shape), like=param)
        return [...]

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
            if self._saved_state is not None:
                self.generator.set_state(self._saved_state)
                self._saved_state = None
        return self.generator

    def rounding_generator(self, device: torch.device) -> torch.Generator:
        """The generator stochastic rounding draws from (created on first use): for a writer of its own rows
        (``hmt_core.int8_weights.embedding.Int8Rows``), so its draws continue this writer's sequence and state."""
        return self._generator(device)

    @contextlib.contextmanager
    def rows(self, param: Tensor, master: Tensor | None, index: Any = ...,
             keep: Tensor | None = None) -> Iterator[Tensor]:
        """Yields the tensor to update in place for ``param[index]`` (the weight's data, not the Parameter).
        ``keep`` (() bool on the weight's device, a step skipped on the device): True leaves the rows (and their
        master) as they were, through ``torch.where``, at the cost of a copy of the rows."""
        if is_quantized(param):
            yield from self._quantized_rows(param, index, keep)
            return
        w = param[index]
        if master is not None:
            target = master[index]
        elif w.dtype != torch.float32 and (self.stochastic or self.probe is not None):
            target = w.float()  # fp32 temporary of these rows
        else:
            old = None if keep is None else w.clone()
            yield w  # in place in the weight's own dtype: the update rounds to nearest as it is applied
            if old is not None:
                torch.where(keep, old, w, out=w)
            return
        before = target.clone() if self.probe is not None or (keep is not None and master is not None) else None
        yield target
        if keep is not None and master is not None:
            torch.where(keep, before, target, out=target)
        if self.stochastic and master is None:
            gen = None if is_fake(target) else self._generator(target.device)
            rounded = stochastic_round(target, gen)
            if keep is None:
                w.copy_(rounded)
            else:
                torch.where(keep, w, rounded, out=w)
        else:
            w.copy_(target)  # round-to-nearest
        if self.probe is not None:
            self.probe(param, index, target - before)

    def fused(self, param: Any, update: Tensor) -> bool:
        """Whether ``write_update`` applies an update to ``param`` in one fused kernel (a quantized weight whose
        kernel runs for ``update``'s device, no probe); else the caller goes through ``rows``."""
        return is_quantized(param) and self.probe is None and param.fuses_update(update)

    def write_update(self, param: QuantizedWeight, index: Any, update: Tensor, *, step_size: float, lr: float,
                     weight_decay: float, style: str,
                     keep: Tensor | None = None) -> None:  # update: (rows, cols) fp32, of param[index]
        """``rows`` + ``apply_update_`` in one kernel: dequantize, W ← W − step_size·U with the style's decoupled
        weight decay, requantize by stochastic rounding from this writer's generator (the same draws). ``keep``
        (() bool, a step skipped on the device): the stored rows are put back through ``torch.where``."""
        param.update_rows(index, update, step_size=step_size, decay=lr * weight_decay, decay_after=style != "torch",
                          generator=None if is_fake(update) else self._generator(update.device), keep=keep)

    def _quantized_rows(self, param: QuantizedWeight, index: Any, keep: Tensor | None) -> Iterator[Tensor]:
        target = param.read_rows(index)  # fp32: the high-precision domain of the update
        before = target.clone() if self.probe is not None else None
        yield target
        param.write_rows(index, target, None if is_fake(target) else self._generator(target.device), keep)
        if self.probe is not None:
            self.probe(param, index, target - before)

    def state_dict(self) -> dict[str, Any]:
        state = self.generator.get_state() if self.generator is not None else self._saved_state
        return {"seed": self.seed, "generator": state}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        saved = state.get("generator")
        if saved is None:
            return
        if self.generator is not None:
            self.generator.set_state(saved.cpu())
        else:
            self._saved_state = saved.detach().cpu().clone()
