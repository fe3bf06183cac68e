"""Update precision for low-precision (BF16) weights: fp32 master weights and stochastic rounding.

BF16 keeps 8 significant bits, so a weight w moves under round-to-nearest only if the update exceeds half its
unit in the last place, ulp(w)/2 = 2^(⌊log₂|w|⌋ − 8). An Adam step is ≈ lr per element; at a fine-tuning lr of 1e-5
every weight with |w| ≥ 2⁻⁸ ≈ 0.004 (most of a Llama weight initialized with std 0.02) keeps its value and the
update is lost, step after step. Two remedies, chosen per method (``master_weights`` / ``stochastic_rounding``):

- **fp32 master weights** (Micikevicius et al., 2018, "Mixed Precision Training", §3.1): the optimizer applies its
  update to an fp32 copy of each low-precision trainable weight and the BF16 weight is refreshed from it by
  round-to-nearest; small updates accumulate in the copy. Costs 4 bytes per weight element, counted as optimizer
  state (the methods list the copies in ``state_tensors()``).
- **stochastic rounding** (Gupta et al., 2015, "Deep Learning with Limited Numerical Precision", Eq. 2; Q-GaLore
  applies it to INT8 weights, Zhang et al., 2024): the fp32 result x of the update, lying between the adjacent
  representable values ⌊x⌋ and ⌈x⌉ = ⌊x⌋ + ε, is stored as ⌈x⌉ with probability (x − ⌊x⌋)/ε and as ⌊x⌋ otherwise,
  so E[SR(x)] = x: small updates survive in expectation, at the price of rounding noise of variance
  ε²·p(1 − p) ≤ ε²/4. No persistent memory beyond a random generator; the update runs through fp32 row chunks.

``stochastic_round`` is the rounding as a pure function (bit arithmetic on the fp32 pattern; reusable for other
storage formats); ``UpdateWriter`` is the bookkeeping an optimizer uses to route its fp32 update to the weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

# How many rows of an fp32 temporary a stochastic-rounding write may hold at once (bytes of one chunk).
CHUNK_BYTES = 16 << 20
_LOW_BITS = 1 << 16  # BF16 is the upper 16 bits of the fp32 pattern: 16 bits are rounded away
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as int32


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
    if is_fake(x):
        noise = torch.empty(x.shape, dtype=torch.int32, device=x.device)  # shape only: same bytes, no draws
    else:
        noise = torch.randint(0, _LOW_BITS, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    bits = noise.add_(x.contiguous().view(torch.int32)).bitwise_and_(_HIGH_MASK)
    out = bits.view(torch.float32).to(dtype)  # the lower 16 bits are zero: the conversion is exact
    return out.masked_fill_(torch.isnan(x), float("nan"))


def write_rows(shape: tuple[int, ...], chunk_bytes: int | None = None) -> list[Any]:
    """Row spans (indices) of a weight of ``shape`` such that one fp32 row chunk holds ≤ ``chunk_bytes`` (default
    ``CHUNK_BYTES``); 0-d and 1-d weights are one span (``...``)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    if len(shape) < 2:
        return [...]
    rows = max(1, chunk_bytes // max(1, 4 * (int(torch.Size(shape).numel()) // max(1, shape[0]))))
    if rows >= shape[0]:
        return [...]
    return [slice(a, min(a + rows, shape[0])) for a in range(0, shape[0], rows)]


# A probe sees every write routed through an fp32 value: (the parameter, the row index, the fp32 update that the
# optimizer computed for those rows, i.e. fp32 value after − before). Benchmarks use it to measure lost updates.
Probe = Callable[[Tensor, Any, Tensor], None]


class UpdateWriter:
    """Routes an optimizer's update to a weight: in place (the default: the update is applied to the weight in its
    own dtype), into the weight's fp32 master copy (then copied into the weight, round-to-nearest), or into an fp32
    temporary of some rows that is then rounded stochastically into the weight.

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

    def spans(self, param: Tensor, master: Tensor | None) -> list[Any]:
        """Row indices to write ``param`` in: one span unless the write goes through fp32 temporaries."""
        if master is None and param.dtype != torch.float32 and (self.stochastic or self.probe is not None):
            return write_rows(tuple(param.shape))
        return [...]

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
            if self._saved_state is not None:
                self.generator.set_state(self._saved_state)
                self._saved_state = None
        return self.generator

    @contextlib.contextmanager
    def rows(self, param: Tensor, master: Tensor | None, index: Any = ...) -> Iterator[Tensor]:
        """Yields the tensor to update in place for ``param[index]`` (the weight's data, not the Parameter)."""
        w = param[index]
        if master is not None:
            target = master[index]
        elif w.dtype != torch.float32 and (self.stochastic or self.probe is not None):
            target = w.float()  # fp32 temporary of these rows
        else:
            yield w  # in place in the weight's own dtype: the update rounds to nearest as it is applied
            return
        before = target.clone() if self.probe is not None else None
        yield target
        if self.stochastic and master is None:
            gen = None if is_fake(target) else self._generator(target.device)
            w.copy_(stochastic_round(target, gen))
        else:
            w.copy_(target)  # round-to-nearest
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
