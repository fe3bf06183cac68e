"""CUDA smoke tests: one real training step per method setting and per activation preset on a micro model, on
the GPU, with the memory meter's peak compared against the CUDA allocator's (``torch.cuda.max_memory_allocated``).

Skipped (one line) without a CUDA device; ``python -m benchmarks.gpu_validate`` runs them first
(``pytest -m cuda``) and records the outcome. Each test is bounded by 30 s (``pytest.mark.timeout``).

What is compared. The allocator's peak over the measured steps, minus what was allocated before the model was
built (``base``: the cuBLAS/cuBLASLt workspaces of the main thread and of autograd's device thread, created by a
warm-up matmul and its backward, and anything an earlier test left), against the meter's peak less the state that
bitsandbytes' paged optimizers keep in CUDA managed memory, outside the caching allocator
(``experiments.memory.meter``, source ``cuda``: every tensor an ATen op returns, by storage). Two steps
are measured so the lazily created optimizer state exists at the second step's peak, as in the runner
(``METERED_STEPS``). Tolerance: ``|allocated − meter| ≤ 5 % · allocated + 2 MiB``. The 5 % is what the meter
does not see: workspaces that kernels allocate through the caching allocator inside one op (cuBLASLt, SDPA
backends, bitsandbytes' paged buffers) and the allocator's rounding of every block up to 512 bytes; the 2 MiB
covers a second cuBLAS workspace (HMT's basis-prefetch stream) on a model whose whole step is ~50 MiB.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA smoke tests: no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

from device_methods import BASELINES, CUDA_ONLY_BASELINES, HMT, model_dtype  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(30)]

MiB = 2**20
RTOL, SLACK_BYTES = 0.05, 2 * MiB  # see the module docstring
METHODS = {**BASELINES, **CUDA_ONLY_BASELINES, **HMT}


def _micro_model(dtype: str):
    from experiments.config import ModelConfig

    # the runner's "tiny" shape: ~5.3M parameters, a step of ~50 MiB, so the absolute slack stays small
    return ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688, vocab_size=4096,
                       max_position_embeddings=256, dtype=dtype)


def _clean_base(device: torch.device) -> int:
    """Bytes allocated before the model exists, after the cuBLAS workspaces have been created: one per (thread,
    stream) that runs a GEMM, so the backward's matmuls (autograd's device thread) make their own."""
    gc.collect()
    torch.cuda.empty_cache()
    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    ((a @ a).float() @ a.float()).sum().backward()
    del a
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def measured_steps(label: str, preset: str = "none", *, steps: int = 2) -> dict:
    """``steps`` real training steps of ``METHODS[label]`` with the activation ``preset``; the runner's set-up
    (experiments.train) in miniature. Returns the loss, the meter's and the allocator's peaks."""
    from experiments.loop import autocast_context, train_step
    from experiments.memory.meter import MemoryMeter
    from experiments.models import build_model
    from hmt_core.activations import apply_policy
    from hmt_core.activations.policy import ActivationPolicy
    from hmt_core.state_bytes import iter_state_tensors

    device = torch.device("cuda", torch.cuda.current_device())
    base = _clean_base(device)
    paged = bnb_paged_tensors()
    paged_before = len(paged)
    torch.manual_seed(0)
    method = METHODS[label]()
    model = method.prepare(build_model(_micro_model(model_dtype(label)), device=device))
    model.train()
    meter = MemoryMeter(source="cuda")
    meter.track(model.parameters(), "params")
    meter.track(iter_state_tensors([getattr(p, "quant_state", None) for p in model.parameters()]), "params")
    meter.track(model.buffers(), "other")
    meter.watch_grads(model.parameters())
    method.attach(model, max_grad_norm=1.0)
    policy = ActivationPolicy.preset(preset)
    handle = None if policy.is_identity() else apply_policy(model, policy)
    gen = torch.Generator().manual_seed(1)
    micro = [torch.randint(0, 4096, (2, 128), generator=gen).to(device) for _ in range(2)]
    torch.cuda.reset_peak_memory_stats(device)
    losses = []
    for _ in range(steps):
        method.set_lr_scale(1.0)
        with meter:
            loss, _ = train_step(model, method, micro, meter=meter, skip_nonfinite=True,
                                 autocast=lambda: autocast_context(device, True))
        losses.append(float(loss))  # the test reads it; the step itself never syncs
    torch.cuda.synchronize(device)
    meter.remove_hooks()
    if handle is not None:
        handle.remove()
    return {"losses": losses, "meter_peak": meter.report().peak_bytes,
            "allocated_peak": torch.cuda.max_memory_allocated(device) - base, "base": base,
            "paged": sum(t.numel() * t.element_size() for t in paged[paged_before:])}


def bnb_paged_tensors() -> list:
    """bitsandbytes' list of the paged (CUDA managed memory) buffers its paged optimizers allocated."""
    from bitsandbytes.functional import GlobalPageManager

    return GlobalPageManager.get_instance().paged_tensors


def check_peaks(label: str, r: dict) -> None:
    allocated, metered = r["allocated_peak"], r["meter_peak"] - r["paged"]
    bound = RTOL * allocated + SLACK_BYTES
    summary = (f"{label}: allocator peak {allocated / MiB:.2f} MiB (above a base of {r['base'] / MiB:.2f} MiB), "
               f"meter peak {metered / MiB:.2f} MiB (less {r['paged'] / MiB:.2f} MiB paged), "
               f"|diff| {abs(allocated - metered) / MiB:.2f} MiB, "
               f"bound {bound / MiB:.2f} MiB; losses {r['losses']}")
    assert all(math.isfinite(x) for x in r["losses"]), summary
    assert abs(allocated - metered) <= bound, summary


@pytest.mark.parametrize("label", list(METHODS))
def test_one_training_step_per_method(label):
    check_peaks(label, measured_steps(label))


@pytest.mark.parametrize("preset", ["full_ckpt", "selective", "hmt"])
def test_one_training_step_per_activation_preset(preset):
    check_peaks(f"hmt-mode-a-default + activation={preset}", measured_steps("hmt-mode-a-default", preset))
