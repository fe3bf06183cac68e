"""Measured activation metrics: bytes autograd keeps per component, reconstruction error, gradient agreement.

Saved bytes are *measured*: the pack hook of ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor
autograd saves for backward, and the bytes counted are those of what the hook returns (the compressed form
when a codec applies), de-duplicated by storage so a tensor saved by several ops (q/k/v_proj all save their
input) or a view of a larger buffer is counted once, at its storage size. Inputs that a recompute region keeps
alive (non-reentrant ``torch.utils.checkpoint`` holds them in its closure, not through the hooks) are added by
the region wrapper. Parameters are never counted.

Metrics (flat dict, units in the key): ``act/<component>/saved(bytes)``, ``act/total/saved(bytes)``,
``act/<component>/rel_err`` = ||x - x^|| / ||x|| over all tensors the component compressed in the probe step,
``act/grad_cos`` = cos(g_policy, g_keep) of the probed parameters' gradients (the first decoder layer's) on a
probe batch, and ``act/<component>/grad_cos`` the same with only that component's lossy action applied (an
ablation).

The probe (``hmt_core.activations.probe``) compares a policy's gradients with keep's using these measures.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
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
    """Sum of ||x - x^||^2 and ||x||^2 per component, for rel_err = sqrt(err / ref).

    Each tensor is compared in fp32 on its own device and its sums are added to 0-dim float64 tensors, so nothing
    is read back (no device sync) until ``rel_err``; on shape-only (fake) tensors the same ops run and the read
    gives NaN."""

    def __init__(self) -> None:
        self.err: dict[str, Tensor] = {}
        self.ref: dict[str, Tensor] = {}

    def add(self, component: str, x: Tensor, x_hat: Tensor) -> None:
        x = x.detach().float()
        err = torch.linalg.vector_norm(x - x_hat.detach().float()).double().square()
        ref = torch.linalg.vector_norm(x).double().square()
        self.err[component] = err if component not in self.err else self.err[component] + err
        self.ref[component] = ref if component not in self.ref else self.ref[component] + ref

    def rel_err(self) -> dict[str, float]:
        out = {}
        for c in self.err:
            err, ref = _read(self.err[c]), _read(self.ref[c])
            out[c] = (err / ref) ** 0.5 if ref > 0 else (0.0 if ref == 0 else float("nan"))
        return out


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
    """The model's accumulated ``.grad`` tensors, flattened into one float64 vector (tests and small benchmarks
    only: a full-size float64 copy; the probe compares gradients per tensor instead)."""
    return torch.cat([p.grad.detach().reshape(-1).double() for p in model.parameters() if p.grad is not None])


def cosine(a: Tensor, b: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def _read(t: Tensor) -> float:
    """``float(t)``; NaN for a shape-only (fake) tensor, which has no value."""
    return float("nan") if is_fake(t) else float(t)


class GradAgreement:
    """cos(a, b) of two gradient lists without concatenating them: ⟨a, b⟩, ‖a‖², ‖b‖² are accumulated tensor by
    tensor, in fp32 chunks of at most ``chunk`` elements on the gradients' device, into a (3,) float64 tensor; the
    temporaries are two fp32 chunks, whatever the model size. ``None`` (an unused parameter) counts as zeros."""

    def __init__(self, chunk: int = 1 << 22) -> None:
        self.chunk = chunk
        self.sums: Tensor | None = None

    def add(self, a: Tensor | None, b: Tensor | None) -> None:
        like = a if a is not None else b
        if like is None:
            return
        if self.sums is None:
            self.sums = torch.zeros(3, dtype=torch.float64, device=like.device)
        a = a.detach().reshape(-1) if a is not None else None
        b = b.detach().reshape(-1) if b is not None else None
        for i in range(0, like.numel(), self.chunk):
            x = a[i:i + self.chunk].float() if a is not None else None
            y = b[i:i + self.chunk].float() if b is not None else None
            zero = torch.zeros((), dtype=torch.float32, device=like.device)
            self.sums += torch.stack([torch.dot(x, y) if x is not None and y is not None else zero,
                                      torch.dot(x, x) if x is not None else zero,
                                      torch.dot(y, y) if y is not None else zero]).double()

    def cosine(self) -> float:
        """⟨a, b⟩ / (‖a‖ ‖b‖); 0 when either is zero (``cosine_similarity``'s convention), NaN on fake tensors."""
        if self.sums is None or is_fake(self.sums):
            return float("nan")
        dot, aa, bb = (float(v) for v in self.sums.tolist())
        return dot / math.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0
