"""The dry run's target device (``dryrun.device``): the dispatch decisions ``mode=dryrun`` traces are the target's.

The trace runs on fake CPU tensors whatever the target (docs/dryrun-cuda.md says why: in a CPU-only torch, fake
CUDA tensors run the forward but not the backward, whose autograd engine asks the CUDA runtime for streams).
``dryrun.device=cuda`` makes every decision the code takes from a tensor's device the one a CUDA run takes:

- optimizer kernels: chosen explicitly (``baselines.driver.torch_optimizer_impl``: fused AdamW by default), so a
  FakeTensor takes the same path as a CUDA tensor, whatever the target;
- HMT's Triton kernels (``hmt_core.kernels.fake_tensors_on("cuda")``: ``use_triton`` counts fake tensors as CUDA
  tensors), whose custom ops' fake implementations allocate what the Triton launch allocates.

Autocast keeps CPU's op lists: which ops run in BF16 is decided by the AutocastCPU/AutocastCUDA dispatch keys of
the tensors' device, not by any setting. For the ops of a decoder step (linear, matmul, SDPA in BF16; SiLU and
cross entropy; the model's RMSNorm and RoPE casting to fp32 themselves) both lists agree (tests/test_dispatch.py);
docs/dryrun-cuda.md lists where they differ.
"""

from __future__ import annotations

import contextlib

import torch

from hmt_core import kernels


def dispatch_as(target: torch.device) -> contextlib.AbstractContextManager:
    """The trace's dispatch decisions are ``target``'s (fake tensors count as ``target`` tensors where the code
    decides by device)."""
    return kernels.fake_tensors_on(target.type)
