"""The activation probe: one step (no update) that measures a policy's saved bytes, each codec's reconstruction
error and the gradient agreement with keep (``act/grad_cos``, ``act/<component>/grad_cos``).

The probe is bounded so that it can run before step 0 of a large model (``probe``): one sequence of at most
``PROBE_TOKENS`` tokens, the keep reference by exact recomputation, gradients of one decoder layer only, compared
tensor by tensor in fp32 chunks with float64 running sums (no flattened copies). Callers run it under the memory
meter and report its peak beside the step's (``experiments.dryrun.metered_probe``); a dry run traces it too, so
the dry run's verdict covers it. It stays on (not behind a flag): at this size its peak is below a training
step's (``tests/test_dryrun_fidelity.py``), and rel_err / grad_cos are the only check that a lossy policy is
harmless.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from hmt_core.activations.apply import apply_policy, llama_scopes
from hmt_core.activations.measure import ErrorAccumulator, GradAgreement, saved_metrics
from hmt_core.activations.policy import CODEC_ACTIONS, PRESETS

PROBE_TOKENS = 512  # the probe's batch: one sequence of at most this many tokens (``probe_batch``)
PROBE_LAYERS = (0,)  # decoder layers whose parameter gradients the probe compares (``probe_params``)


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
