"""Kernel backend switch for HMT's fused ops: Triton kernels or their PyTorch fallbacks.

Backends (``BACKENDS``):
- ``"auto"`` (default): Triton for the kernels that fuse work (the update, Adam, the codecs) when every tensor is on
  CUDA and ``triton`` imports, else the PyTorch fallback; plain GEMMs (the projection) always ``torch.matmul``
  (fake tensors count as CUDA tensors inside ``fake_tensors_on("cuda")``: a dry run with ``dryrun.device=cuda``);
- ``"triton"``: always Triton, GEMMs included — on CUDA, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
  how the tests check the kernels without a GPU); raises if neither is possible;
- ``"torch"``: always the PyTorch fallback.

The backend is process-global (``set_backend`` / the ``using`` context manager; initial value from the
``HMT_KERNELS`` environment variable) and an optimizer config may override it per call (``resolve``).
Importing this package never imports triton; the kernels live in ``quant`` (blockwise INT8/FP8 codecs,
Dettmers et al. 2022), ``lowrank`` (GaLore's projection and reconstruction, Zhao et al. 2024; Adam, Kingma &
Ba 2015) and ``int8_weight`` (dequantization of INT8 weights with per-block scales, Q-GaLore, Zhang et al. 2024;
its custom op ``hmt::int8_weight_dequant`` is in ``hmt_core.int8_weights.codec``), the other custom ops in ``ops``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

BACKENDS = ("auto", "triton", "torch")

_state = {"backend": os.environ.get("HMT_KERNELS", "auto"), "fake_device": "cpu"}


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, got {name!r}")
    return name


def set_backend(name: str) -> None:
    _state["backend"] = _check(name)


def get_backend() -> str:
    return _check(_state["backend"])


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


@contextlib.contextmanager
def fake_tensors_on(device_type: str) -> Iterator[None]:
    """Within: ``use_triton`` takes fake tensors (FakeTensorMode) for tensors on ``device_type`` ("cuda" | "cpu").
    A dry run traces on fake CPU tensors; with ``dryrun.device=cuda`` it takes the decisions of a CUDA run (the
    Triton op, whose fake implementation allocates what the launch allocates) instead of the CPU fallback's."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"fake tensors stand for cuda or cpu tensors, got {device_type!r}")
    previous = _state["fake_device"]
    _state["fake_device"] = device_type
    try:
        yield
    finally:
        _state["fake_device"] = previous


def on_cuda(t: Tensor) -> bool:
    """``t`` is a CUDA tensor, or a fake one standing for a CUDA tensor (``fake_tensors_on("cuda")``)."""
    return t.is_cuda or (_state["fake_device"] == "cuda" and is_fake(t))


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: Tensor, backend: str | None = None, gemm: bool = False) -> bool:
    """Whether an op on ``tensors`` runs its Triton kernel under ``backend`` (None or "": the global one).
    ``gemm``: the op is a plain matrix product with nothing to fuse (the projection ``Pᵀ G``): ``"auto"`` sends it to
    ``torch.matmul`` (cuBLAS, tuned per shape and GPU) rather than the untuned 64×64×32-tile Triton matmul, which
    runs only when ``"triton"`` is asked for by name."""
    name = _check(backend) if backend else get_backend()
    if name == "torch" or (gemm and name == "auto"):
        return False
    every_on_cuda = all(on_cuda(t) for t in tensors)
    if name == "auto":
        return every_on_cuda and triton_available()
    if not triton_available():
        raise RuntimeError("kernels backend 'triton' requested but the triton package is not installed "
                           "(pip install 'hmt[triton]')")
    if not (every_on_cuda or interpreting()):
        raise RuntimeError("kernels backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 (set before triton "
                           "is imported) to run the kernels on CPU in Triton's interpreter")
    return True


def div_rn(t: Tensor, divisor: float) -> Tensor:
    """``t / divisor`` correctly rounded on every device, as the kernels' ``tl.math.div_rn``. A Python number as the
    divisor takes ATen's CUDA shortcut ``t * (1 / divisor)`` (``div_true_kernel_cuda``: a CPU-scalar divisor "may lose
    one bit of precision"), so the same fallback would round differently on CPU and CUDA; a 0-dim tensor on ``t``'s
    device keeps the IEEE division (one fill kernel, no host synchronization)."""
    return t / t.new_full((), divisor)
