"""INT8-weight Linear layers for HMT (Q-GaLore, Zhang et al., 2024, §3.3: INT8 weights, updated in high precision
and requantized by stochastic rounding), and the handle through which HMT's optimizer updates them.

``Int8Linear`` replaces a projected ``nn.Linear`` (or a ``transformers`` ``Conv1D``, kept in its (in, out) layout):

- ``weight_codes`` (int8, the weight's own shape) and ``weight_scales`` (fp32, one per block of ``block`` elements
  of a row) are ``nn.Parameter``s with ``requires_grad=False``: the memory meter counts them as ``params`` like
  any weight, and checkpoints store them (``trained_in_place``);
- ``weight`` is a *phantom* parameter: a ``requires_grad`` leaf of the weight's logical shape and dtype whose
  storage is one element (``expand``), so the projection rule (``hmt_core.selection.projected_weight_names``), parameter
  counts, the meter's gradient marks, ``.grad`` and post-accumulate-grad hooks (HMT's per-layer updates) all work
  as for a BF16 weight: the weight gradient autograd accumulates into ``weight.grad`` is a real, full-size tensor.

``Int8LinearFunction`` (a ``torch.autograd.Function``) dequantizes the weight in forward and again in backward,
one layer at a time: the dequantized copy is a local of each pass, freed when it returns, and never saved for
backward (only the input is, as ``nn.Linear`` saves it). Under activation checkpointing the recomputed forward
dequantizes again. The compute dtype is autocast's when autocast is on, else the model's weight dtype; gradients
are returned in the dtypes of the input, the weight and the bias, as ``F.linear`` under autocast does.

``Int8Weight`` is what an HMT ``Slot`` holds instead of the ``nn.Parameter``: ``.grad`` and hooks are the
phantom's, ``read_rows`` dequantizes rows to fp32 and ``write_rows`` requantizes them by stochastic rounding
(``hmt_core.precision.QuantizedWeight``; the ``UpdateWriter`` supplies the seeded generator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn import functional as F
from torch.utils.weak import WeakIdKeyDictionary

from hmt_core import kernels
from hmt_core.int8_weights.codec import BLOCK, dequantize, int8_update, quantize
from hmt_core.module_tensors import replace_owned_tensors
from hmt_core.precision import chunk_rows_for, random_halfwords

ROLE = "hmt_int8_role"  # attribute of an Int8Linear's parameters: "phantom" | "codes" | "scales"


def role(t: Any) -> str | None:
    return getattr(t, ROLE, None)


def trained_in_place(t: Any) -> bool:
    """INT8 codes and scales: not ``requires_grad``, yet changed by every update (checkpoints store them)."""
    return role(t) in ("codes", "scales")


# fills a module's own meta tensors (not its children's) on the training device with their initial values; a module
# with none is left as it is
Materialize = Callable[[nn.Module], None]


def is_phantom(t: Any) -> bool:
    return role(t) == "phantom"


def _tagged(t: Tensor, name: str, requires_grad: bool) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=requires_grad)
    setattr(p, ROLE, name)
    return p


class Int8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, layer: Int8Linear) -> Tensor:
        # x: (..., in); weight: the phantom, only its gradient edge is used; -> (..., out)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        with torch.autocast(device, enabled=False):
            xc = x.to(dtype)
            out = layer.apply_weight(xc, layer.dequantized(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xc)
        ctx.layer, ctx.dtype, ctx.x_dtype = layer, dtype, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # grad_out: (..., out)
        (xc,) = ctx.saved_tensors
        layer, dtype = ctx.layer, ctx.dtype
        g = grad_out.to(dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w = layer.dequantized(dtype)  # (out, in) | Conv1D (in, out); freed at once
            grad_x = (g @ w.t() if layer.transposed else g @ w).to(ctx.x_dtype)
            del w
        g2, x2 = g.reshape(-1, g.shape[-1]), xc.reshape(-1, xc.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = (x2.t() @ g2 if layer.transposed else g2.t() @ x2).to(layer.weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(layer.bias.dtype)
        return grad_x, grad_w, grad_b, None


class Int8Storage:
    """State-dict behaviour shared by the INT8 layers (``Int8Linear``, ``hmt_core.int8_weights.embedding``): they
    hold ``weight`` (the phantom), ``weight_codes``, ``weight_scales``, ``block`` and ``dequantized(dtype)``."""

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Codes, scales and bias, and as ``weight`` the dequantized weight in the model's dtype (not the phantom):
        a Hugging Face export (``save_pretrained``) loads into a plain model with the trained values. A streamed
        layer's released codes (no storage) are not read: the streamer's model-level hook writes its ``weight`` from
        the host copies (``hmt_core.streaming``)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight_codes.untyped_storage().nbytes() or not self.weight_codes.numel():
            destination[prefix + "weight"] = self.dequantized(self.weight.dtype).detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Codes and scales are loaded as they are; a state without them (a plain model's) is quantized from its
        ``weight`` (round-to-nearest). The phantom itself is never written."""
        key = prefix + "weight"
        state = {k: v for k, v in state_dict.items() if k != key}
        if prefix + "weight_codes" not in state and key in state_dict:
            codes, scales = quantize(state_dict[key].to(self.weight_codes.device), self.block)
            state[prefix + "weight_codes"], state[prefix + "weight_scales"] = codes, scales
        phantom = self._parameters["weight"]
        self._parameters["weight"] = None  # skipped by the loader; the key keeps its place (parameter order)
        try:
            super()._load_from_state_dict(state, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self._parameters["weight"] = phantom


class Int8Linear(Int8Storage, nn.Linear):
    """A Linear whose weight is INT8 codes + block scales (see the module docstring). ``transposed``: the weight
    is stored (in, out) as ``transformers``' ``Conv1D`` does. Construct with ``from_module``."""

    def __init__(self, codes: Tensor, scales: Tensor, bias: nn.Parameter | None, *, dtype: torch.dtype,
                 block: int = BLOCK, transposed: bool = False, backend: str | None = None) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a full-precision weight
        rows, cols = codes.shape
        self.in_features, self.out_features = (rows, cols) if transposed else (cols, rows)
        self.block, self.transposed, self.backend = block, transposed, backend
        self.weight = _tagged(torch.empty((), dtype=dtype, device=codes.device).expand(rows, cols), "phantom", True)
        self.weight_codes = _tagged(codes, "codes", False)  # (rows, cols) int8
        self.weight_scales = _tagged(scales, "scales", False)  # (rows, nb) fp32
        self.bias = bias
        self.handle = Int8Weight(self)

    @classmethod
    @torch.no_grad()
    def from_module(cls, module: nn.Module, *, block: int = BLOCK, backend: str | None = None,
                    device: torch.device | None = None) -> Int8Linear:
        """Quantize ``module``'s weight (round-to-nearest, row chunks: at most one chunk budget of fp32 temporaries);
        ``device``: quantized there from a copy of the weight (the module itself is left where it is)."""
        w = module.weight.detach() if device is None else module.weight.detach().to(device)
        transposed = not isinstance(module, nn.Linear)  # Conv1D: (in, out)
        codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        scales = torch.empty((w.shape[0], -(-w.shape[1] // block)), dtype=torch.float32, device=w.device)
        step = chunk_rows_for(tuple(w.shape), torch.float32, like=w)
        for a in range(0, w.shape[0], step):
            codes[a:a + step], scales[a:a + step] = quantize(w[a:a + step], block)
        bias = module.bias if isinstance(getattr(module, "bias", None), nn.Parameter) else None
        if bias is not None and device is not None:
            bias = nn.Parameter(bias.detach().to(device), requires_grad=bias.requires_grad)
        return cls(codes, scales, bias, dtype=w.dtype, block=block, transposed=transposed, backend=backend)

    def dequantized(self, dtype: torch.dtype) -> Tensor:  # -> the weight's shape, dtype (a temporary)
        return dequantize(self.weight_codes, self.weight_scales, self.block, dtype, backend=self.backend)

    def apply_weight(self, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        return F.linear(x, w.t() if self.transposed else w, bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() == 0:  # the fused loss's (B, 0, H) slice (hmt_core.fused_ce): no dequantized copy, no gradient
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
            return x.new_zeros((*x.shape[:-1], self.out_features), dtype=dtype)
        return Int8LinearFunction.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8 block={self.block}" + (", (in, out) layout" if self.transposed else ""))


class Int8Weight:
    """An INT8 weight as HMT's optimizer sees it (``Slot.param``): the phantom's gradient and hooks, the weight's
    shape/dtype/device, and fp32 row access for updates (``hmt_core.precision.QuantizedWeight``)."""

    def __init__(self, layer: Int8Linear) -> None:
        self.layer = layer

    # ---- what the optimizer reads of a parameter
    @property
    def grad(self) -> Tensor | None:
        return self.layer.weight.grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        self.layer.weight.grad = value

    @property
    def data(self) -> Int8Weight:  # the optimizer writes ``param.data``: the writer routes it here
        return self

    @property
    def shape(self) -> torch.Size:
        return self.layer.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.weight_codes.device

    requires_grad = True

    def numel(self) -> int:
        return self.layer.weight.numel()

    def dim(self) -> int:
        return 2

    def is_floating_point(self) -> bool:
        return True

    def element_size(self) -> int:  # of the logical (gradient) dtype
        return self.layer.weight.element_size()

    def __getattr__(self, name: str) -> Any:  # anything else a Parameter has: the phantom's (shape-level) answer
        if name.startswith("_") or name == "layer":
            raise AttributeError(name)
        return getattr(self.layer.weight, name)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Any], None]):
        return self.layer.weight.register_post_accumulate_grad_hook(lambda _: hook(self))

    # ---- the update's round trip
    def read_rows(self, index: Any) -> Tensor:  # -> (rows, cols) fp32
        layer = self.layer
        return dequantize(layer.weight_codes[index], layer.weight_scales[index], layer.block, torch.float32,
                          backend=layer.backend)

    def write_rows(self, index: Any, value: Tensor, generator: torch.Generator | None,  # value: fp32
                   keep: Tensor | None = None) -> None:  # keep: () bool, True: a skipped step, the codes stay
        codes, scales = quantize(value, self.layer.block, generator, stochastic=True)
        for stored, new in ((self.layer.weight_codes[index], codes), (self.layer.weight_scales[index], scales)):
            if keep is None:
                stored.copy_(new)
            else:  # decided on the device (requantizing unchanged values is not the identity under SR): one op
                torch.where(keep, stored, new, out=stored)

    def fuses_update(self, update: Tensor) -> bool:
        layer = self.layer
        return kernels.use_triton(layer.weight_codes, layer.weight_scales, update, backend=layer.backend)

    def update_rows(self, index: Any, update: Tensor, *, step_size: float, decay: float, decay_after: bool,
                    generator: torch.Generator | None,
                    keep: Tensor | None = None) -> None:  # update: (rows, cols) fp32; keep: () bool
        """``read_rows`` → W − step_size·U (decay ``decay`` = ηλ) → ``write_rows`` in one kernel: the noise is drawn
        from ``generator`` first, the draws ``write_rows``' stochastic rounding makes. ``keep`` (a step skipped on
        the device): the codes and scales are put back (requantizing is not the identity under SR)."""
        layer = self.layer
        codes, scales = layer.weight_codes[index], layer.weight_scales[index]
        old = None if keep is None else (codes.clone(), scales.clone())
        noise = random_halfwords(update.shape, generator, device=update.device, fake=is_fake(update))
        int8_update(codes, scales, update, noise, layer.block,
                    step_size=step_size, decay=decay, decay_after=decay_after, backend=layer.backend)
        if old is not None:
            torch.where(keep, old[0], codes, out=codes)
            torch.where(keep, old[1], scales, out=scales)

    def stored_tensors(self) -> tuple[nn.Parameter, nn.Parameter]:
        """The tensors that hold the weight's values (what weight streaming moves): its codes and scales."""
        return self.layer.weight_codes, self.layer.weight_scales

    def exported(self, codes: Tensor, scales: Tensor) -> Tensor:  # -> the weight's shape and dtype
        """The weight a state dict exports (``Int8Storage``) from ``codes`` and ``scales`` stored elsewhere (a
        streamed weight's host copies)."""
        layer = self.layer
        return dequantize(codes, scales, layer.block, layer.weight.dtype, backend=layer.backend)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors())


def quantize_linears(model: nn.Module, names: set[str], *, block: int = BLOCK, backend: str | None = None,
                     device: torch.device | None = None, materialize: Materialize | None = None) -> int:
    """Replace the modules owning the weights ``names`` (qualified ``<module>.weight``) by ``Int8Linear``; returns
    how many were converted (already converted ones are left as they are). A weight shared with another module
    (tied embeddings) is refused with a ValueError: the other module would lose its weight. ``device``: each module
    is quantized there from a copy of its weight (a model built elsewhere reaches the device as INT8, one
    full-precision module at a time); ``materialize``: a model built on meta has each module's own tensors made and
    initialised (on ``device``) just before it is quantized."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    converted = 0
    for name in sorted(names):
        mod_name = name.removesuffix(".weight")
        module = model.get_submodule(mod_name)
        if isinstance(module, Int8Linear):
            continue
        if counts.get(id(module.weight), 0) > 1:
            raise ValueError(f"method.weight_dtype=int8: {name} is shared with another module (tied weights); "
                             "leave it out of method.target_patterns")
        parent_name, _, child = mod_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if materialize is not None:
            materialize(module)
        setattr(parent, child, Int8Linear.from_module(module, block=block, backend=backend, device=device))
        converted += 1
    return converted


def place_on(model: nn.Module, device: torch.device, materialize: Materialize | None = None) -> None:
    """Move ``model``'s parameters and buffers not yet on ``device`` there by replacing them (a new ``Parameter``
    per tensor, shared ones kept shared), not by ``Module.to``, which swaps tensors in place (FakeTensorMode's
    tensors cannot be swapped) and would materialize an INT8 layer's stride-0 phantom weight had it not moved yet.
    Each module is first handed to ``materialize``, which makes its meta tensors, if any, on ``device``."""
    moved = WeakIdKeyDictionary()  # a tensor off the device -> its copy on it, made once if shared

    def to_device(t: Tensor) -> Tensor:
        if is_phantom(t):  # an INT8 layer is made where its codes are: never moved after
            raise ValueError(f"place_on: an INT8 phantom weight is on {t.device}, not {device}")
        return t.detach().to(device)

    for module in model.modules():
        if materialize is not None:
            materialize(module)
        replace_owned_tensors(module, lambda t: not _on(t, device), to_device, moved)


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """``t`` is on ``device``; a device without an index (``"cuda"``) stands for whichever ``t`` is on."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def int8_layers(model: nn.Module) -> list[Int8Linear]:
    return [m for m in model.modules() if isinstance(m, Int8Linear)]
