"""Kernel dispatch is the same on real tensors, in the dry run (fake tensors) and on CUDA.

torch's optimizers pick their implementation by tensor type and device when left to choose (``foreach=None``):
a FakeTensor gets the single-tensor loop, a real CUDA tensor the multi-tensor kernels. The baselines choose
explicitly (``method.impl``), so the ops a step dispatches are counted here on real CPU tensors, fake CPU tensors
(the dry run) and fake CUDA tensors (``FakeTensorMode`` makes them in a CPU-only torch; an optimizer step on them
is the dispatch a CUDA run takes) and must be the same. HMT's Triton ops: ``dryrun.device=cuda`` takes the
decision a CUDA tensor gets, and the ops traced on the kernel path are those the kernel path runs.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import batches, tiny_llama

from baselines import adamw, qlora
from hmt_core import kernels
from baselines.driver import torch_optimizer_impl
from hmt_core.kernels import ops
from hmt_core.projection import Basis


class OpCounter(TorchDispatchMode):
    """Counts every compute op dispatched, and records each op's output (shape, dtype) in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.outputs: list[tuple[str, tuple, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).startswith(("prim.", "profiler.")):  # metadata queries (fake mode asks devices) and markers
            return out
        self.ops[str(func)] += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), tuple(t.shape), t.dtype))
        return out


def _model(device: str) -> nn.Module:
    model = nn.ParameterDict({name: nn.Parameter(torch.ones(shape, dtype=torch.bfloat16, device=device))
                              for name, shape in (("w1", (8, 16)), ("b1", (8,)), ("w2", (4, 8)))})
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # values do not matter: only which kernels run is compared
    return model


def _step_ops(impl: str, fake_device: str | None) -> Counter[str]:
    """Ops of two ``method=adamw`` optimizer steps (the first creates the state) on real CPU tensors
    (``fake_device=None``) or fake tensors on ``fake_device``."""
    with FakeTensorMode() if fake_device else torch.device("cpu"):
        model = _model(fake_device or "cpu")
        opt = adamw.build(model, adamw.Config(impl=impl)).optimizer
        counter = OpCounter()
        with counter:
            opt.step()
            opt.step()
    return counter.ops


KERNEL = {"fused": "aten._fused_adamw_.default", "foreach": "aten._foreach_sqrt.default", "single": "aten.sqrt.default"}


@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
def test_adamw_runs_the_chosen_kernels_on_real_fake_and_fake_cuda_tensors(impl):
    real, fake, fake_cuda = _step_ops(impl, None), _step_ops(impl, "cpu"), _step_ops(impl, "cuda")
    assert fake == real, f"dry run (fake CPU) dispatches {fake}, a real step {real}"
    assert fake_cuda == real, f"fake CUDA dispatches {fake_cuda}, a real CPU step {real}"
    others = [k for name, k in KERNEL.items() if name != impl]
    # 3 parameters (2 weights, 1 bias), 2 steps: one fused/foreach call per step, one sqrt per parameter per step
    assert real[KERNEL[impl]] == (6 if impl == "single" else 2), real
    assert not any(real[k] for k in others), real


def test_torch_optimizer_impl_is_explicit_for_every_choice():
    assert torch_optimizer_impl("fused") == {"fused": True, "foreach": False}
    assert torch_optimizer_impl("foreach") == {"fused": False, "foreach": True}
    assert torch_optimizer_impl("single") == {"fused": False, "foreach": False}
    with pytest.raises(ValueError, match="impl"):
        torch_optimizer_impl("auto")


@pytest.mark.parametrize("make", [
    lambda: adamw.Config(impl="apex"),
    lambda: adamw.Config(impl="foreach", eight_bit=True),
    lambda: adamw.Config(impl="single", master_weights=True),
    lambda: qlora.Config(impl="foreach", optimizer="adamw8bit"),
    lambda: qlora.Config(impl="none"),
])
def test_impl_refuses_what_it_cannot_choose(make):
    with pytest.raises(ValueError, match="method.impl"):
        make()


# ------------------------------------------------------------------------------------------ HMT Triton kernels
def _fake(device: str, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def test_dryrun_cuda_target_takes_the_triton_decision_of_a_cuda_tensor():
    with FakeTensorMode():
        cpu, cuda = _fake("cpu", 8, 4), _fake("cuda", 8, 4)
        on_cuda = kernels.use_triton(cuda)  # what a CUDA run decides ("auto": CUDA and triton importable)
        assert on_cuda == kernels.triton_available()
        assert not kernels.use_triton(cpu)  # dryrun.device=cpu: the fallback, as on a CPU run
        with kernels.fake_tensors_on("cuda"):
            assert kernels.use_triton(cpu) == on_cuda
        assert not kernels.use_triton(cpu)  # restored on exit
    assert not kernels.use_triton(torch.zeros(2))  # real CPU tensors are never taken for CUDA ones
    with kernels.fake_tensors_on("cuda"):
        assert not kernels.use_triton(torch.zeros(2))


def test_auto_sends_plain_gemms_to_torch_matmul_and_fusing_kernels_to_triton():
    """``auto`` on (fake) CUDA tensors: the projection GEMM goes to torch.matmul (cuBLAS), the fusing kernels to
    Triton where it imports; asked for by name, Triton runs the GEMM too; ``torch`` never runs Triton."""
    with FakeTensorMode(), kernels.fake_tensors_on("cuda"):
        t = _fake("cpu", 8, 4)
        assert not kernels.use_triton(t, backend="auto", gemm=True)
        assert kernels.use_triton(t, backend="auto") == kernels.triton_available()
        assert not kernels.use_triton(t, backend="torch", gemm=True)
        if kernels.triton_available():
            assert kernels.use_triton(t, backend="triton", gemm=True)


def _lowrank_step(make, backend: str | None, gemm_backend: str | None = None) -> OpCounter:
    """HMT's kernel-path helpers on one (32, 24) weight with a two-sided rank-4 basis; ops recorded. The Adam
    step gets a non-contiguous gradient, which the kernel reads through a contiguous copy. ``gemm_backend``: the
    projection's (default: ``backend``)."""
    w, grad = make(32, 24), make(32, 24)
    basis = Basis(make(32, 4), make(4, 24))
    m, v = make(4, 4), make(4, 4).abs()  # v: a second moment (>= 0)
    counter = OpCounter()
    with counter:
        low = ops.project(grad, basis, backend=gemm_backend or backend)
        d, step_size = ops.adam_step(m, v, low.t(), 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, style="torch",
                                     backend=backend)
        ops.lowrank_update(w, d, basis, scale=1.0, step_size=step_size, lr=1e-3, weight_decay=0.0, style="torch",
                           backend=backend)
    return counter


def test_triton_path_traces_the_ops_and_tensors_the_kernels_run():
    """The dry run (fake CPU tensors, ``dryrun.device=cuda``, backend auto) against what auto runs on CUDA (real CPU
    tensors: the fusing kernels in Triton's interpreter, the projection GEMMs in torch.matmul): the same ops, each
    returning tensors of the same shapes and dtypes — the custom ops' fake implementations allocate what the
    launches allocate."""
    real = _lowrank_step(lambda *s: torch.randn(s), "triton", gemm_backend="torch")
    with FakeTensorMode(), kernels.fake_tensors_on("cuda"):
        fake = _lowrank_step(lambda *s: torch.empty(s), None)
    assert fake.outputs == real.outputs, f"dry run {fake.outputs}\nkernels {real.outputs}"
    # two-sided projection: two cuBLAS GEMMs (Pᵀ G, then (Pᵀ G) Q) and the update's factor U Qᵀ (r, in), no
    # Triton matmul under auto
    assert real.ops["aten.mm.default"] == 3 and "hmt.project.default" not in real.ops, real.ops
    assert real.ops["hmt.adam_lowrank_.default"] == 1, real.ops
    assert real.ops["hmt.lowrank_update_.default"] == 1, real.ops
    assert real.ops["aten.clone.default"] == 1, real.ops  # the Adam kernel's contiguous copy of the gradient


def test_resume_keeps_the_runs_kernels_not_the_checkpoints():
    """A checkpoint written by torch's implicit choice (``foreach=None``, before ``method.impl`` existed) resumes on
    the run's kernels: torch's ``load_state_dict`` would restore the saved ``fused``/``foreach`` options."""
    model = _model("cpu")
    old = torch.optim.AdamW(model.parameters(), lr=1e-3)  # what a run before method.impl built
    old.step()
    method = adamw.make(adamw.Config(impl="fused"))
    method.attach(model, max_grad_norm=None)
    method.load_state_dict({"optimizer": old.state_dict(), "base_lrs": [1e-3]})
    opt = method.driver.optimizer
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(True, False)], opt.param_groups
    counter = OpCounter()
    with counter:
        opt.step()
    assert counter.ops["aten._fused_adamw_.default"] == 1 and not counter.ops["aten.sqrt.default"], counter.ops


# --------------------------------------------------------------------------------------------------- autocast
@contextlib.contextmanager
def cuda_autocast():
    """``torch.autocast("cuda", torch.bfloat16)``'s thread-local state, set without its CUDA-availability check, so
    the AutocastCUDA kernels (in every torch build) act on fake CUDA tensors in a CPU-only torch."""
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)


def _autocast_dtype(op, device: str, in_dtype: torch.dtype) -> torch.dtype:
    with FakeTensorMode():
        x = torch.empty(16, 16, dtype=in_dtype, device=device)  # no indexing: it needs a CUDA device guard
        with torch.autocast("cpu", dtype=torch.bfloat16) if device == "cpu" else cuda_autocast():
            return op(x).dtype


DECODER_OPS = {  # what a decoder step runs under autocast (RMSNorm and RoPE cast to fp32 themselves)
    "linear": lambda x: F.linear(x, x.t()),
    "matmul": lambda x: x @ x,
    "sdpa": lambda x: F.scaled_dot_product_attention(*(x.view(1, 1, 16, 16),) * 3, is_causal=True),
    "silu": F.silu,
    "cross_entropy": lambda x: F.cross_entropy(x, torch.zeros(16, dtype=torch.long, device=x.device)),
}
CUDA_FP32_ONLY = {  # on CUDA's fp32 list, not on CPU's: a BF16 input runs in fp32 on CUDA, in BF16 in the dry run
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "rms_norm": lambda x: F.rms_norm(x, (16,)),
    "pow": lambda x: x.pow(2),
    "sum": lambda x: x.sum(),
}


@pytest.mark.parametrize("name", sorted(DECODER_OPS))
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_dryrun_autocast_gives_a_decoder_step_the_dtypes_cuda_gives(name, in_dtype):
    op = DECODER_OPS[name]
    cpu, cuda = _autocast_dtype(op, "cpu", in_dtype), _autocast_dtype(op, "cuda", in_dtype)
    assert cpu == cuda, f"{name} on {in_dtype}: dry run (CPU autocast) {cpu}, CUDA autocast {cuda}"


@pytest.mark.parametrize("name", sorted(CUDA_FP32_ONLY))
def test_documented_autocast_differences_hold(name):
    """docs/dryrun-cuda.md lists these as the ops whose BF16 inputs CUDA autocast runs in fp32 and CPU autocast does
    not; if torch changes its lists, this fails and the page must be updated."""
    op = CUDA_FP32_ONLY[name]
    got = (_autocast_dtype(op, "cpu", torch.bfloat16), _autocast_dtype(op, "cuda", torch.bfloat16))
    assert got == (torch.bfloat16, torch.float32), f"{name}: (CPU, CUDA) autocast dtypes {got}"


# -------------------------------------------------------------------------------------------------- numerics
def test_fused_adamw_is_the_single_tensor_update_up_to_rounding():
    """One step at a time from the same state (fp32 tiny Llama, weight decay on): fused and single-tensor AdamW
    compute the same formula in fp32 in another operation order, so each weight's difference is a few roundings of
    its update. Tolerance 1e-4 of the step's largest update: ~10x the 7.5e-6 measured (docs/dryrun-cuda.md), while
    a formula difference (bias correction, decay order) would show at O(1e-1..1) of it."""
    model = tiny_llama(0, torch.float32)
    config = dict(lr=1e-3, weight_decay=0.1)
    single = adamw.build(model, adamw.Config(impl="single", **config)).optimizer
    for step, ids in enumerate(batches(3)):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        twin = copy.deepcopy(model)
        fused = adamw.build(twin, adamw.Config(impl="fused", **config)).optimizer
        fused.load_state_dict(copy.deepcopy(single.state_dict()))
        for g in fused.param_groups:  # load_state_dict restored the single-tensor group options
            g["fused"], g["foreach"] = True, False
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = p.grad.clone()
        before = [p.detach().clone() for p in model.parameters()]
        single.step()
        fused.step()
        update = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
        diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(model.parameters(), twin.parameters()))
        assert update > 0 and diff <= 1e-4 * update, \
            f"step {step}: max |fused - single| {diff:.3e}, largest update {update:.3e}"


@pytest.mark.parametrize("name", ["adamw", "galore", "apollo", "hmt"])
def test_every_method_is_a_method_and_says_which_torch_optimizer_holds_its_state(name: str) -> None:
    """The checkpointer reaches a method only through ``hmt_core.method.Method``: the baselines hand over their
    ``torch.optim`` optimizer, whose groups carry the base rates the LR schedule scales (``initial_lr``); HMT has
    none (its state is its slots')."""
    from experiments import methods
    from hmt_core.method import Method

    model = nn.ModuleDict({"mlp": nn.Linear(8, 8, bias=False), "head": nn.Linear(8, 4, bias=False)})
    raw = {"name": name, "lr": 2e-3} | ({} if name == "adamw" else {"target_patterns": ["mlp"], "rank": 2})
    method = methods.make_method(methods.make_config(raw))
    model = method.prepare(model)
    method.attach(model, max_grad_norm=1.0)
    assert isinstance(method, Method)
    opt = method.torch_optimizer()
    if name == "hmt":
        assert opt is None
        return
    assert isinstance(opt, torch.optim.Optimizer)
    method.set_lr_scale(0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25 * g["initial_lr"] for g in opt.param_groups], opt.param_groups
    assert all(g["initial_lr"] > 0 for g in opt.param_groups)
    saved = method.state_dict()
    method.set_lr_scale(1.0)
    for group in opt.param_groups:  # a resume restores the base rates with the groups
        group["initial_lr"] = 9.0
    method.load_state_dict(saved)
    method.set_lr_scale(0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5 * g["initial_lr"] for g in saved["optimizer"]["param_groups"]]
