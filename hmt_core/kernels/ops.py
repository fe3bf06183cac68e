"""Custom ops for HMT's low-rank optimizer step (GaLore, Zhao et al. 2024, Alg. 2; Adam, Kingma & Ba 2015, Alg. 1;
decoupled weight decay, Loshchilov & Hutter 2019), each a ``torch.library.custom_op`` with a fake implementation
(FakeTensorMode dry runs and torch.compile see one opaque op), running the Triton kernel of
``hmt_core.kernels.lowrank`` when ``hmt_core.kernels.use_triton`` says so and a PyTorch fallback otherwise:

- ``hmt::lowrank_update_``: ``W ← W − c·(A B)`` with decoupled decay, the reconstruction ``P U Qᵀ`` given as
  factors (A, B). The fallback reconstructs ``chunk_rows`` rows at a time, so its temporaries are bounded by
  ``chunk_rows × in`` elements instead of a full-size ``P U Qᵀ`` (plus ``α·`` and ``lr·`` copies of it); with one
  chunk it performs exactly the ops of ``project_back_scaled`` + ``apply_update_`` (bit-identical).
- ``hmt::project``: ``Ĝ = Pᵀ G`` | ``G Q`` | ``Pᵀ G Q`` (``hmt_core.projection.project``); a plain GEMM, so only
  with the ``"triton"`` backend: ``"auto"`` calls ``torch.matmul`` (cuBLAS) for it.
- ``hmt::adam_lowrank_``: Adam moments in place + the step direction (``adam_moments_`` + ``adam_step``).

The helpers ``lowrank_update`` / ``project`` / ``adam_step`` are what the optimizer calls: they call the op when
the kernel runs and the fallback *function* directly otherwise, so that the memory meter (a TorchDispatchMode,
which sees a custom op as one call) still counts the fallback's real temporaries. On the kernel path each op's
fake implementation allocates exactly the tensors its Triton launch returns (none for ``lowrank_update_``), and
what the launch allocates besides (``project``'s two-sided intermediate, ``adam_``'s fp32 copy of the gradient)
is made by the helper, outside the op, where the meter and a dry run (``dryrun.device=cuda``) see it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hmt_core import adam as upd
from hmt_core import kernels
from hmt_core.kernels.chunks import chunk_rows_for
from hmt_core.projection import Basis
from hmt_core.projection import project as project_torch


# --------------------------------------------------------------------------------------------- fused update
def lowrank_update_torch(weight: Tensor, a: Tensor, b: Tensor, scale: float, step_size: float, decay: float,
                         decay_after: bool, chunk_rows: int) -> None:
    """weight: (out, in) in place; a: (out, k); b: (k, in). Row-chunked: at most one (chunk_rows, in) temporary."""
    rows = weight.shape[0]
    chunk = chunk_rows if chunk_rows > 0 else chunk_rows_for(tuple(weight.shape), torch.result_type(a, b),
                                                               like=weight)
    for i in range(0, rows, chunk):
        w = weight[i:i + chunk]
        full = torch.matmul(a[i:i + chunk], b)  # (chunk, in)
        if scale != 1.0:
            full.mul_(scale)
        # decay = ηλ: lr 1 and weight decay ηλ (1.0 · ηλ is ηλ exactly); hf decays after the step
        upd.apply_update_(w, full, step_size=step_size, lr=1.0, weight_decay=decay,
                          style="hf" if decay_after else "torch")
        del full


@torch.library.custom_op("hmt::lowrank_update_", mutates_args=("weight",))
def lowrank_update_(weight: Tensor, a: Tensor, b: Tensor, scale: float, step_size: float, decay: float,
                    decay_after: bool, chunk_rows: int, backend: str = "") -> None:
    # weight: (out, in) in place; a: (out, k); b: (k, in)
    if kernels.use_triton(weight, a, b, backend=backend):
        from hmt_core.kernels import lowrank  # imports triton: only where a Triton kernel runs (also below)
        lowrank.fused_update_(weight, a, b, coef=step_size * scale, decay=decay, decay_after=decay_after)
    else:
        lowrank_update_torch(weight, a, b, scale, step_size, decay, decay_after, chunk_rows)


@lowrank_update_.register_fake
def _(weight, a, b, scale, step_size, decay, decay_after, chunk_rows, backend="") -> None:
    return None


def factors(direction: Tensor, basis: Basis) -> tuple[Tensor, Tensor]:
    """(A, B) with A B = project_back(direction, basis), in the association project_back uses.
    direction: (out, r) | (r, in) | (r, r) -> A: (out, k), B: (k, in)."""
    d = direction.to((basis.left if basis.left is not None else basis.right).dtype)
    if basis.left is not None and basis.right is not None:
        return basis.left, torch.matmul(d, basis.right)  # P, U Qᵀ (r, in)
    if basis.right is not None:
        return d, basis.right
    return basis.left, d


def lowrank_update(weight: Tensor, direction: Tensor, basis: Basis, *, scale: float, step_size: float, lr: float,
                   weight_decay: float, style: str, backend: str | None = None, chunk_rows: int = 0) -> None:
    """W ← W − step_size·α·project_back(direction) with the style's decoupled weight decay (``apply_update_``)."""
    a, b = factors(direction, basis)
    args = (weight, a, b, float(scale), float(step_size), float(lr * weight_decay), style == "hf", int(chunk_rows))
    if kernels.use_triton(weight, a, b, backend=backend):
        torch.ops.hmt.lowrank_update_(*args, backend or kernels.get_backend())
    else:
        lowrank_update_torch(*args)


# ------------------------------------------------------------------------------------------------ projection
@torch.library.custom_op("hmt::project", mutates_args=())
def project_op(grad: Tensor, left: Tensor | None, right: Tensor | None, backend: str = "") -> Tensor:
    # grad: (out, in), left: (out, r) | None, right: (r, in) | None -> (r, in) | (out, r) | (r, r)
    if left is None and right is None:
        raise ValueError("hmt::project needs a left or a right basis")
    if kernels.use_triton(*(t for t in (grad, left, right) if t is not None), backend=backend, gemm=True):
        from hmt_core.kernels import lowrank
        return lowrank.project(grad, left, right)
    return project_torch(grad, Basis(left, right))


@project_op.register_fake
def _(grad, left, right, backend=""):
    rows = left.shape[1] if left is not None else grad.shape[0]
    cols = right.shape[0] if right is not None else grad.shape[1]
    return grad.new_empty((rows, cols))


def project(grad: Tensor, basis: Basis, *, backend: str | None = None) -> Tensor:
    """grad: (out, in) -> Ĝ (low-rank): ``projection.project`` (torch.matmul) unless the Triton matmul is asked for
    by name (``kernels.use_triton(gemm=True)``)."""
    tensors = [t for t in (grad, *basis) if t is not None]
    if kernels.use_triton(*tensors, backend=backend, gemm=True):
        name = backend or kernels.get_backend()
        if basis.left is not None and basis.right is not None:  # the kernel's two launches, one op each, so the
            low = torch.ops.hmt.project(grad, basis.left, None, name)  # meter sees the (r, in) intermediate
            return torch.ops.hmt.project(low, None, basis.right, name)
        return torch.ops.hmt.project(grad, basis.left, basis.right, name)
    return project_torch(grad, basis)


# ---------------------------------------------------------------------------------------------------- Adam
def adam_step_size(t: int, *, lr: float, beta1: float, beta2: float, style: str) -> float:
    """The scalar that ``adam_step`` returns beside D (torch folds η_t into D: 1.0)."""
    return 1.0 if style == "torch" else lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)


@torch.library.custom_op("hmt::adam_lowrank_", mutates_args=("m", "v"))
def adam_lowrank_(m: Tensor, v: Tensor, g: Tensor, t: int, lr: float, beta1: float, beta2: float, eps: float,
                  hf: bool, backend: str = "") -> Tensor:
    # m, v: (a, b) state, updated in place; g: (a, b) -> D: (a, b) fp32 (W ← W − adam_step_size · D)
    style = "hf" if hf else "torch"
    if kernels.use_triton(m, v, g, backend=backend) and m.is_contiguous() and v.is_contiguous():
        from hmt_core.kernels import lowrank
        return lowrank.adam_(m, v, g, beta1=beta1, beta2=beta2, step=lr / (1.0 - beta1 ** t),
                             sqrt_bc2=(1.0 - beta2 ** t) ** 0.5, eps=eps, hf=hf)
    m32, v32 = upd.adam_moments_(m, v, g, beta1, beta2, style)
    return upd.adam_step(m32, v32, t, lr=lr, beta1=beta1, beta2=beta2, eps=eps, style=style)[0]


@adam_lowrank_.register_fake
def _(m, v, g, t, lr, beta1, beta2, eps, hf, backend=""):
    return g.new_empty(g.shape, dtype=torch.float32)


def adam_fuses(m: Tensor, v: Tensor, g: Tensor, *, backend: str | None = None) -> bool:
    """Whether ``adam_step`` runs the Triton kernel (which takes no ``factors``)."""
    return kernels.use_triton(m, v, g, backend=backend) and m.is_contiguous() and v.is_contiguous()


def adam_step(m: Tensor, v: Tensor, g: Tensor, t: int, *, lr: float, beta1: float, beta2: float, eps: float,
              style: str, backend: str | None = None, factors: Tensor | None = None) -> tuple[Tensor, float]:
    """(D, step_size) of ``update.adam_step`` after ``adam_moments_``; m, v updated in place. g: fp32. ``factors``:
    ``adam_moments_``'s device-side betas (the fallback only: ``adam_fuses`` is False)."""
    if adam_fuses(m, v, g, backend=backend):
        if factors is not None:
            raise ValueError("the fused Adam kernel takes no moment factors (adam_fuses: skip by snapshot)")
        g = g.float().contiguous()  # the launch's input (lowrank.adam_), here where the meter sees a copy
        d = torch.ops.hmt.adam_lowrank_(m, v, g, t, lr, beta1, beta2, eps, style == "hf",
                                        backend or kernels.get_backend())
        return d, adam_step_size(t, lr=lr, beta1=beta1, beta2=beta2, style=style)
    m32, v32 = upd.adam_moments_(m, v, g, beta1, beta2, style, factors)
    return upd.adam_step(m32, v32, t, lr=lr, beta1=beta1, beta2=beta2, eps=eps, style=style)
