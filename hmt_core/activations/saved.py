"""What a ``saved_tensors_hooks`` pack returns for a saved activation, and its unpack: the tensor itself, a codec's
``Packed`` (``hmt_core.activations.codecs``), a host copy (offload), or a checkpointed layer input stored by a codec
(full activation checkpointing, Chen et al. 2016, with the stored layer inputs compressed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from hmt_core.activations.codecs import Packed, decode


class Offloaded:
    def __init__(self, t: Tensor) -> None:
        self.device = t.device
        self.t = t.detach().to("cpu", non_blocking=True)


class LayerInput(NamedTuple):
    """A checkpointed layer input stored by a codec (``requires_grad`` restored: the recompute saves as forward did)."""
    packed: Any
    requires_grad: bool


def unpack(obj: Any) -> Tensor:
    if isinstance(obj, LayerInput):
        return unpack(obj.packed).requires_grad_(obj.requires_grad)
    if isinstance(obj, Packed):
        return decode(obj)
    if isinstance(obj, Offloaded):
        return obj.t.to(obj.device, non_blocking=True)
    return obj


def input_pack(pack: Callable[[Tensor], Any], x: Tensor) -> Callable[[Tensor], Any]:
    """Pack hook for what a checkpoint saves of its inputs: ``x`` (the layer input) through ``pack`` (a codec's),
    any other input as is. Holds ``x`` by a weak reference only: autograd keeps the pack hook as long as the saved
    input, and a strong one would keep the original alive next to its codes."""
    ref, shape = StorageWeakRef(x.untyped_storage()), x.shape

    def pack_input(t: Tensor) -> Any:
        if t.shape != shape or StorageWeakRef(t.untyped_storage()) != ref:
            return t.detach()
        return LayerInput(pack(t), t.requires_grad)

    return pack_input
