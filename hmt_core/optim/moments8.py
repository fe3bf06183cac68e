"""8-bit block-wise Adam moments (Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization", §2: the
dynamic tree map, one absmax per block) for a dense weight HMT updates in row chunks that bitsandbytes' AdamW8bit
cannot step: the INT8 input embedding (``method.embedding_dtype=int8`` with ``method.dense_8bit=true``; its weight is
INT8 codes, not a tensor bitsandbytes can write), and the row-updated embedding (``method.embedding_update``,
``hmt_core.optim.row_adam``: any set of rows is read and written on its own, through ``decode`` / ``encode``).

For a moment x (rows, cols) and blocks of ``block`` consecutive columns of a row (the INT8 weights' layout,
``hmt_core.int8_weights.codec``: a row chunk is requantized on its own):

    a[i, k] = max_{j ∈ block k} |x[i, j]|,   c[i, j] = argmin_c |M[c] − x[i, j] / a[i, ⌊j/b⌋]|,   x̂ = M[c]·a

with M bitsandbytes' dynamic map (``create_dynamic_map``: signed for m, unsigned for v; 256 sorted values in
[−1, 1] / [0, 1], dense near 0 over 7 decades) and c stored as uint8: 1 byte per element + 4 bytes per block, as
bitsandbytes' blockwise state. An update reads a row chunk of both moments as fp32, runs Adam's arithmetic on it and
stores it back (round-to-nearest on the map).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hmt_core.int8_weights.codec import BLOCK, block_absmax, scaled_op


def dynamic_map(signed: bool) -> Tensor:  # -> (256,) fp32, ascending
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``: for each decade
    10^(i−6), i = 0..6, the midpoints of a linear grid on [0.1, 1] scaled to it (2^i of them signed, 2^(i+1)
    unsigned), their negatives when signed, and 0 and 1."""
    values = [0.0, 1.0]
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((bounds[:-1] + bounds[1:]) / 2.0 * 10 ** (i - 6)).tolist()
        values += means + ([-x for x in means] if signed else [])  # 2 + 2·Σ 2^i = 2 + Σ 2^(i+1) = 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def decode(codes: Tensor, absmax: Tensor, value_map: Tensor, block: int) -> Tensor:
    """x̂ = M[c]·a: codes (r, cols) uint8, absmax (r, nb) fp32, value_map (256,) -> (r, cols) fp32."""
    values = value_map[codes.long()]  # M[c]
    return scaled_op(torch.mul, values, absmax, block, values)


def encode(x: Tensor, bounds: Tensor, block: int) -> tuple[Tensor, Tensor]:  # x: (r, cols) fp32
    """(codes (r, cols) uint8, absmax (r, nb) fp32) of ``x``, round-to-nearest on the map whose midpoints are
    ``bounds`` (255,)."""
    absmax = block_absmax(x, block)
    y = scaled_op(torch.div, x, torch.where(absmax > 0, absmax, 1.0), block, torch.empty_like(x))
    return torch.bucketize(y, bounds).to(torch.uint8), absmax


class Moments8:
    """Adam's m (signed map) and v (unsigned map) of a (rows, cols) weight in 8 bits; see the module docstring."""

    def __init__(self, shape: tuple[int, int], device: torch.device, block: int = BLOCK) -> None:
        rows, cols = shape
        nb = -(-cols // block)
        self.block = block
        self.maps = (dynamic_map(True).to(device), dynamic_map(False).to(device))
        self.bounds = tuple((m[1:] + m[:-1]) / 2 for m in self.maps)  # (255,): nearest code = bucketize
        self.codes = (torch.zeros(shape, dtype=torch.uint8, device=device),
                      torch.zeros(shape, dtype=torch.uint8, device=device))  # (rows, cols) each
        self.absmax = (torch.zeros(rows, nb, device=device), torch.zeros(rows, nb, device=device))  # zero: x̂ = 0

    def tensors(self) -> tuple[Tensor, ...]:  # the state (the maps are constants of the format, not state)
        return (*self.codes, *self.absmax)

    def _read(self, k: int, rows: slice) -> Tensor:  # -> (r, cols) fp32
        return decode(self.codes[k][rows], self.absmax[k][rows], self.maps[k], self.block)

    def read(self, rows: slice) -> tuple[Tensor, Tensor]:
        """(m, v) of these rows as fresh fp32 tensors (r, cols)."""
        return self._read(0, rows), self._read(1, rows)

    def _write(self, k: int, rows: slice, x: Tensor, keep: Tensor | None) -> None:  # x: (r, cols) fp32
        codes, absmax = encode(x, self.bounds[k], self.block)
        if keep is not None:  # a step skipped on the device: the stored codes stay
            codes = torch.where(keep, self.codes[k][rows], codes)
            absmax = torch.where(keep, self.absmax[k][rows], absmax)
        self.codes[k][rows].copy_(codes)
        self.absmax[k][rows].copy_(absmax)

    def write(self, rows: slice, m: Tensor, v: Tensor, keep: Tensor | None = None) -> None:
        """Store fp32 (m, v) of these rows (round-to-nearest on the maps); ``keep`` (() bool): leave them."""
        self._write(0, rows, m, keep)
        self._write(1, rows, v, keep)

    def state_dict(self) -> dict[str, Tensor]:
        return {"m_codes": self.codes[0], "v_codes": self.codes[1], "m_absmax": self.absmax[0],
                "v_absmax": self.absmax[1]}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for mine, key in zip(self.tensors(), ("m_codes", "v_codes", "m_absmax", "v_absmax")):
            mine.copy_(state[key])
