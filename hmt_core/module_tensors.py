"""Replacing a module's own parameters and buffers with new tensors, keeping a tensor shared by two modules
(tied weights) shared: the one step of moving a model (``hmt_core.int8_weights.place_on``) and of making a
meta-built model on its device (``experiments.dist.meta_init.materializer``) without ``Module.to`` or
``Module.to_empty``, which swap tensors in place (FakeTensorMode's tensors cannot be swapped)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

from torch import Tensor, nn


def replace_owned_tensors(module: nn.Module, select: Callable[[Tensor], bool], make: Callable[[Tensor], Tensor],
                          made: MutableMapping[Tensor, Tensor]) -> None:
    """Replace each of ``module``'s own parameters and buffers that ``select`` picks by ``make(t)`` (a parameter
    stays an ``nn.Parameter`` with its ``requires_grad``). ``made`` (an id-keyed map, e.g. a
    ``WeakIdKeyDictionary``, kept across modules) maps an old tensor to its replacement, so a shared one is made
    once and stays shared."""
    for slots in (module._parameters, module._buffers):
        for name, t in list(slots.items()):
            if t is None or not select(t):
                continue
            if t not in made:
                new = make(t)
                made[t] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
            slots[name] = made[t]
