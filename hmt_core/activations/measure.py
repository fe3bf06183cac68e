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

The probe is bounded so that it can run before step 0 of a large model (``probe``): one sequence of at most
``PROBE_TOKENS`` tokens, the keep reference by exact recomputation, gradients of one decoder layer only, compared
tensor by tensor in fp32 chunks with float64 running sums (no flattened copies). Callers run it under the memory
meter and report its peak beside the step's (``experiments.dryrun.metered_probe``); a dry run traces it too, so
the dry run's verdict covers it. It stays on (not behind a flag): at this size its peak is below a training
step's (``tests/test_dryrun_fidelity.py``), and rel_err / grad_cos are the only check that a lossy policy is
harmless.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef

PROBE_TOKENS = 512  # the probe's batch: one sequence of at most this many tokens (``probe_batch``)
PROBE_LAYERS = (0,)  # decoder layers whose parameter gradients the probe compares (``probe_params``)


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


def probe_batch(ids: Tensor, max_tokens: int = PROBE_TOKENS) -> Tensor:
    """The probe's input: the first sequence of ``ids`` (batch, seq), cut to its first ``max_tokens`` tokens, as
    its own (small) tensor."""
    if max_tokens <= 0:
        raise ValueError(f"probe max_tokens must be > 0, got {max_tokens}")
    return ids[:1, :max_tokens].clone()


def probe_params(model: nn.Module, layers: tuple[int, ...] = PROBE_LAYERS) -> list[nn.Parameter]:
    """The trainable parameters whose gradients the probe compares: those of decoder layers ``layers`` of a
    Llama-family model (by default the first, whose gradient is computed through every layer above and so carries
    every compressed activation's error), else (or when those hold none) every trainable parameter."""
    from hmt_core.activations.apply import llama_scopes

    scopes = llama_scopes(model)
    if scopes is not None:
        names = scopes["residual"]  # the decoder layers, in order
        picked = []
        for i in layers:
            if not -len(names) <= i < len(names):
                raise ValueError(f"probe layer {i} out of range for {len(names)} decoder layers")
            picked += [p for p in model.get_submodule(names[i]).parameters() if p.requires_grad]
        if picked:
            return picked
    return [p for p in model.parameters() if p.requires_grad]


def probe(
    model: nn.Module, policy, loss_fn: Callable[[nn.Module], Tensor], *, ablate: bool = True,
    params: list[nn.Parameter] | None = None,
) -> dict[str, float]:
    """One probe step (no optimizer update): saved bytes, rel_err and grad cosine of ``policy`` against keep.

    ``loss_fn(model) -> scalar loss`` runs the forward on a fixed probe batch (``probe_batch``: one sequence, at
    most ``PROBE_TOKENS`` tokens, so the probe's activations are those of a fraction of a training micro-batch).
    Gradients are taken with ``torch.autograd.grad``, never accumulated into ``.grad``: post-accumulate-grad hooks
    (per-layer updates in backward, the meter's gradient marks) do not fire, so the probe may run on a model whose
    method is attached. Only ``params`` (default ``probe_params``: the first decoder layer's) get gradients, and
    they are compared per tensor (``GradAgreement``), never as flattened copies.

    The keep reference is computed with full layer recomputation when the model is Llama-shaped: recomputing a
    layer replays the same ops on the same inputs, so its gradient is keep's, at the memory of the layer inputs.
    Each ablation (``act/<c>/grad_cos``) is ``policy`` with every other lossy codec set back to keep (its
    recompute choices stay: they change memory, not values). The model must not already carry a policy.
    """
    from hmt_core.activations.apply import apply_policy, llama_scopes
    from hmt_core.activations.policy import CODEC_ACTIONS, PRESETS

    params = probe_params(model) if params is None else params
    reference_policy = PRESETS["full_ckpt" if llama_scopes(model) is not None else "none"]

    def grads(pol, errors: ErrorAccumulator | None = None):
        handle = apply_policy(model, pol, errors=errors)
        try:
            g = torch.autograd.grad(loss_fn(model), params, allow_unused=True)
            saved = handle.saved_bytes()
        finally:
            handle.remove()
        return g, saved

    def agreement(g) -> float:
        acc = GradAgreement()
        for a, b in zip(g, reference):
            acc.add(a, b)
        return acc.cosine()

    reference, _ = grads(reference_policy)
    errors = ErrorAccumulator()
    g, saved = grads(policy, errors)
    out = saved_metrics(saved)
    out.update({f"act/{c}/rel_err": e for c, e in sorted(errors.rel_err().items())})
    out["act/grad_cos"] = agreement(g)
    del g
    if ablate:
        lossy = [c for c, action in policy.actions().items() if action in CODEC_ACTIONS]
        for c in lossy:
            g_c, _ = grads(policy.replace(**{o: "keep" for o in lossy if o != c}))
            out[f"act/{c}/grad_cos"] = agreement(g_c)
            del g_c
    return out
