"""Weights born on the host: the build-time half of weight streaming (``method.weight_offload=host``,
``hmt_core.streaming``). A model whose decoder weights do not fit the device must never be whole there, so
``prepare`` gives each streamed weight its host copy (pinned on CUDA) and an empty device storage one module at a
time, as FSDP2's meta-device initialisation makes one unit at a time (Zhao et al. 2023, "PyTorch FSDP"); the
streamer adopts these copies at ``attach``. Start-up peak on the device: the larger of the resident part of the model
and one module at full size (the streamed modules are made and freed before the rest is placed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

_HOST = WeakIdKeyDictionary()  # nn.Parameter (device, storage freed) -> its host copy, until the streamer adopts it


def host_copy(p: Tensor, pinned: bool) -> Tensor:
    """A host tensor holding ``p``'s values (pinned: for asynchronous copies to and from a CUDA device)."""
    if p.storage_offset() != 0 or not p.is_contiguous() or p.untyped_storage().nbytes() != p.numel() * p.element_size():
        raise ValueError("method.weight_offload=host: a streamed weight must own its whole storage (a view or a "
                         "shared storage cannot be freed alone)")
    host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pinned)
    return host.copy_(p.detach())


def _resize(p: Tensor, nbytes: int) -> None:
    p.untyped_storage().resize_(nbytes)


@torch.no_grad()
def place_on_host(model: nn.Module, names: set[str], *, device: torch.device | None,
                  materialize: Callable[[nn.Module], None] | None = None,
                  resize: Callable[[Tensor, int], None] = _resize) -> int:
    """Each parameter of ``model`` named in ``names`` gets a host copy and a freed storage on ``device`` (default:
    where it is); a module built on meta is first made on ``device`` by ``materialize``, one module at a time, and
    a weight off ``device`` (loaded on the host) becomes an empty device tensor. Meta weights with no
    ``materialize`` (FSDP2's meta build, which streaming refuses at attach) are left alone. ``resize(p, nbytes)``
    frees a storage (the streamer's, which tells the memory meter). Returns the bytes placed on the host."""
    placed = 0
    for module_name, module in model.named_modules():
        owned = [(n, p) for n, p in module._parameters.items()
                 if p is not None and (f"{module_name}.{n}" if module_name else n) in names]
        if not owned:
            continue
        if materialize is not None:
            materialize(module)
            owned = [(n, module._parameters[n]) for n, _ in owned]
        for name, p in owned:
            if p.is_meta or p in _HOST:
                continue
            target = device if device is not None else p.device
            host = host_copy(p, pinned=target.type == "cuda")
            if p.device != target:
                moved = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=target), requires_grad=p.requires_grad)
                moved.__dict__.update(p.__dict__)  # tags such as an INT8 layer's tensor roles
                p = moved
                module._parameters[name] = p
            resize(p, 0)
            _HOST[p] = host
            placed += host.numel() * host.element_size()
    return placed


def take(p: Tensor) -> Tensor | None:
    """The host copy ``place_on_host`` made for ``p`` (its device storage freed), handed over once; else None."""
    return _HOST.pop(p, None)


@torch.no_grad()
def restore_untaken(model: nn.Module) -> None:
    """Weights placed on the host that nothing streams (not projected after all) get their device storage back."""
    for p in model.parameters():
        host = _HOST.pop(p, None)
        if host is not None:
            p.untyped_storage().resize_(host.numel() * host.element_size())
            p.data.copy_(host)
