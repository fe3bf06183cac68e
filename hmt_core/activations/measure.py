"""Measured activation metrics: bytes autograd keeps per component, reconstruction error, gradient agreement.

Saved bytes are *measured*: the pack hook of ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor
autograd saves for backward, and the bytes counted are those of what the hook returns (the compressed form
when a codec applies), de-duplicated by storage so a tensor saved by several ops (q/k/v_proj all save their
input) or a view of a larger buffer is counted once, at its storage size. Inputs that a recompute region keeps
alive (non-reentrant ``torch.utils.checkpoint`` holds them in its closure, not through the hooks) are added by
the region wrapper. Parameters are never counted.

Metrics (flat dict, units in the key): ``act/<component>/saved(bytes)``, ``act/total/saved(bytes)``,
``act/<component>/rel_err`` = ||x - x^|| / ||x|| over all tensors the component compressed in the probe step,
``act/grad_cos`` = cos(g_policy, g_keep) of the flattened parameter gradients on a probe batch, and
``act/<component>/grad_cos`` the same with only that component's lossy action applied (an ablation).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef


class SavedBytesCounter:
    """Bytes of saved storages per component for one forward pass (reset at each root forward)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self._seen: dict[StorageWeakRef, StorageWeakRef] = {}

    def reset(self) -> None:
        self.bytes = defaultdict(int)
        self._seen = {}

    def add(self, component: str, tensors: Iterable[Tensor]) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key = StorageWeakRef(storage)
            old = self._seen.get(key)
            if old is not None and not old.expired():  # expired: the address was reused by a new storage
                continue
            self._seen[key] = key
            self.bytes[component] += storage.nbytes()


class ErrorAccumulator:
    """Sum of ||x - x^||^2 and ||x||^2 per component (float64), for rel_err = sqrt(err / ref)."""

    def __init__(self) -> None:
        self.err: dict[str, float] = defaultdict(float)
        self.ref: dict[str, float] = defaultdict(float)

    def add(self, component: str, x: Tensor, x_hat: Tensor) -> None:
        x = x.detach().double()
        self.err[component] += float((x - x_hat.detach().double()).pow(2).sum())
        self.ref[component] += float(x.pow(2).sum())

    def rel_err(self) -> dict[str, float]:
        return {c: (self.err[c] / self.ref[c]) ** 0.5 if self.ref[c] > 0 else 0.0 for c in self.err}


def rel_error(x: Tensor, x_hat: Tensor) -> float:
    """||x - x^|| / ||x|| (0 when x == 0 and x^ == 0)."""
    ref = float(x.double().norm())
    err = float((x.double() - x_hat.double()).norm())
    return err / ref if ref > 0 else err


def saved_metrics(saved: dict[str, int]) -> dict[str, float]:
    out = {f"act/{c}/saved(bytes)": float(b) for c, b in sorted(saved.items())}
    out["act/total/saved(bytes)"] = float(sum(saved.values()))
    return out


def flat_grad(model: nn.Module) -> Tensor:
    """The model's accumulated ``.grad`` tensors, flattened into one float64 vector."""
    return concat_grads(p.grad for p in model.parameters())


def concat_grads(grads: Iterable[Tensor | None]) -> Tensor:
    return torch.cat([g.detach().reshape(-1).double() for g in grads if g is not None])


def cosine(a: Tensor, b: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def probe(
    model: nn.Module, policy, loss_fn: Callable[[nn.Module], Tensor], *, ablate: bool = True
) -> dict[str, float]:
    """One probe step (no optimizer update): saved bytes, rel_err and grad cosine of ``policy`` against keep.

    ``loss_fn(model) -> scalar loss`` runs the forward on a fixed probe batch. Gradients are taken with
    ``torch.autograd.grad``, never accumulated into ``.grad``: post-accumulate-grad hooks (per-layer updates in
    backward, the meter's gradient marks) do not fire, so the probe may run on a model whose method is attached.
    The model must not already carry a policy (``apply_policy`` is called here).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    from hmt_core.activations.apply import apply_policy
    from hmt_core.activations.policy import CODEC_ACTIONS, PRESETS

    def grads(pol, errors: ErrorAccumulator | None = None):
        handle = apply_policy(model, pol, errors=errors)
        try:
            g = concat_grads(torch.autograd.grad(loss_fn(model), params, allow_unused=True))
            saved = handle.saved_bytes()
        finally:
            handle.remove()
        return g, saved

    reference, _ = grads(PRESETS["none"])
    errors = ErrorAccumulator()
    g, saved = grads(policy, errors)
    out = saved_metrics(saved)
    out.update({f"act/{c}/rel_err": e for c, e in sorted(errors.rel_err().items())})
    out["act/grad_cos"] = cosine(g, reference)
    if ablate:
        for c, action in policy.actions().items():
            if action in CODEC_ACTIONS:
                g_c, _ = grads(PRESETS["none"].replace(block_size=policy.block_size, fp8_format=policy.fp8_format,
                                                     outlier_z=policy.outlier_z, modules=policy.modules,
                                                     max_outlier_frac=policy.max_outlier_frac, **{c: action}))
                out[f"act/{c}/grad_cos"] = cosine(g_c, reference)
    return out
