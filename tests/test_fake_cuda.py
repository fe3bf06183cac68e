"""The fake-CUDA tier: every method's update path, the activation codecs, the fused loss and the loop's loss
accumulation traced on ``device="cuda"`` tensors under ``FakeTensorMode``, on a machine without a GPU.

Needs the CUDA build of torch (``torch.version.cuda`` set; set-up in docs/testing.md, "fake-CUDA tier"); on the
CPU build every test here is skipped at collection with one reason. Under FakeTensorMode a CUDA tensor has a
device, a shape and a dtype but no storage, so what is checked is placement: no tensor of a CUDA run silently
lands on the CPU (or the reverse, where a host copy is intended). ``backward()`` cannot run here (autograd's
engine asks the CUDA driver for a context), so each method's update path is driven by hand: every trainable
parameter gets a fake CUDA ``.grad`` (accumulated as autograd does), then its ``register_post_accumulate_grad_hook``
hooks run in reverse parameter order (as backward would call them), then ``step()`` and ``zero_grad()`` as in
``experiments.loop.train_step``. Two steps of two micro-batches each, so lazily created state and the paths of
a step that follows another (lagged clipping, basis reuse, prefetch order) are traced too.

Custom ops (the codecs, the low-rank kernels) run their registered fake implementation under FakeTensorMode;
the codec tests below also call the PyTorch bodies themselves on fake CUDA tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from benchmarks import fake_cuda as fake_cuda_tier
from benchmarks.fake_cuda import fake_cuda, fire_backward
from device_methods import BASELINES, HMT, model_dtype

if torch.version.cuda is None:
    pytest.skip("fake-CUDA tier: needs the CUDA build of torch (docs/testing.md)", allow_module_level=True)
pytestmark = pytest.mark.fake_cuda

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def driver_stand_ins():
    """What needs the CUDA driver itself, replaced for this tier only (``benchmarks.fake_cuda.driver_stand_ins``:
    a CPU generator for ``torch.Generator(device="cuda")``, no-op streams, events and synchronize). The real
    objects run in the CUDA smoke tests (tests/test_cuda_smoke.py)."""
    with fake_cuda_tier.driver_stand_ins():
        yield


def tiny_model(dtype: str = "bf16") -> nn.Module:
    """A tiny Llama (the shape of tests.helpers.tiny_llama) built as the runner builds one: in its dtype, directly
    on the current (fake CUDA) device (``experiments.models.build_model``)."""
    from experiments.config import ModelConfig
    from experiments.models import build_model

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=176, vocab_size=256,
                      max_position_embeddings=128, dtype=dtype)
    return build_model(cfg, device="cuda")


def drive(method, model: nn.Module, *, steps: int = 2, micro: int = 2, max_grad_norm: float | None = 1.0) -> None:
    """``train_step``'s calls into the method, with ``fire_backward`` standing in for ``loss.backward()``."""
    method.attach(model, max_grad_norm=max_grad_norm)
    for _ in range(steps):
        method.set_lr_scale(0.5)
        for i in range(micro):
            method.start_micro_batch(i, micro)
            fire_backward(model)
        method.step()
        method.zero_grad()


def misplaced(named: Iterator[tuple[str, Tensor]], device: torch.device) -> list[str]:
    return [f"{n}: {t.device} {tuple(t.shape)} {t.dtype}" for n, t in named if t.device != device]


def model_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()
    yield from ((f"{n}.grad", p.grad) for n, p in model.named_parameters() if p.grad is not None)


def torch_optim_state(optimizer: torch.optim.Optimizer) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """(device state, host state) of a ``torch.optim`` optimizer: torch keeps the ``step`` counter of a
    non-capturable, non-fused Adam on the host by design (a 0-d CPU tensor); a fused or capturable one keeps it
    on the device (``baselines.driver.torch_optimizer_impl`` picks fused AdamW by default); everything else must
    be on the device."""
    from hmt_core.state_bytes import iter_state_tensors

    host_step = {id(p): not (g.get("fused") or g.get("capturable")) for g in optimizer.param_groups
                 for p in g["params"]}
    device, host = [], []
    for k, (p, st) in enumerate(optimizer.state.items()):
        for key, value in st.items():
            named = [(f"state[{k}].{key}", t) for t in iter_state_tensors(value)]
            on_host = key == "step" and isinstance(value, Tensor) and value.dim() == 0 and host_step.get(id(p), True)
            (host if on_host else device).extend(named)
    return device, host


# ---------------------------------------------------------------------------------------------------- methods
@pytest.mark.parametrize("label", list(BASELINES))
def test_optimizer_method_keeps_everything_on_cuda(label):
    with fake_cuda():
        model = tiny_model(model_dtype(label))
        method = BASELINES[label]()
        model = method.prepare(model)
        drive(method, model)
        opt = method.driver.optimizer
        device_state, host_state = torch_optim_state(opt)
        bad = misplaced(model_tensors(model), CUDA) + misplaced(iter(device_state), CUDA)
        bad += misplaced(iter(host_state), CPU)
    assert device_state, f"{label}: the optimizer holds no state after two steps"
    assert not bad, f"{label}: tensors off their device:\n" + "\n".join(bad)


def hmt_tensors(method) -> Iterator[tuple[str, Tensor]]:
    for s in method.opt.slots:
        for key in ("m", "v", "limiter_prev", "master", "pending"):
            t = getattr(s, key)
            if t is not None:
                yield f"{s.name}.{key}", t
        if s.basis is not None:
            yield from ((f"{s.name}.basis[{i}]", t) for i, t in enumerate(s.basis) if t is not None)
        q = s.param
        if hasattr(q, "layer"):  # an INT8 weight's handle: its codes and scales are the weight
            yield from ((f"{s.name}.int8.{n}", b) for n, b in q.layer.named_buffers())
    for name, opt in method.opt.dense8.items():
        for k, st in enumerate(opt.state.values()):
            yield from ((f"dense8[{name}][{k}].{key}", t) for key, t in st.items() if isinstance(t, Tensor))


@pytest.mark.parametrize("label,clip", [(k, 1.0) for k in HMT if k != "hmt-offload-bases"]
                         + [("hmt-mode-a-default", None), ("hmt-mode-b-rank-1", None)])  # no clipping: in-hook updates
def test_hmt_keeps_everything_on_cuda(label, clip):
    with fake_cuda() as mode:
        model = tiny_model(model_dtype(label))
        method = HMT[label]()
        model = method.prepare(model)
        drive(method, model, max_grad_norm=clip)
        bad = misplaced(model_tensors(model), CUDA) + misplaced(hmt_tensors(method), CUDA)
        projected = sum(s.projected for s in method.opt.slots)
        with_basis = sum(s.basis is not None for s in method.opt.slots if s.projected)
    assert projected and with_basis == projected, f"{label}: {with_basis} of {projected} projected slots have a basis"
    assert not bad, f"{label}: tensors off cuda:0:\n" + "\n".join(bad)
    if not method.opt.dense8:  # bitsandbytes' AdamW8bit reads values (its own business); HMT's code never does
        assert not mode.assumed, f"{label}: data-dependent values asked under fake CUDA at {mode.assumed}"


def test_hmt_offloaded_bases_park_on_the_host_and_work_on_the_device():
    with fake_cuda():
        model = tiny_model()
        method = HMT["hmt-offload-bases"]()
        drive(method, model)
        cache = method.engine.cache
        parked = [(f"{name}.parked[{i}]", t) for name, b in cache.parked.items() for i, t in enumerate(b)
                  if t is not None]
        bases = [(n, t) for n, t in hmt_tensors(method) if ".basis[" in n]  # the slots hold the host copies now
        bad = misplaced(model_tensors(model), CUDA) + misplaced(iter(parked + bases), CPU)
        bad += misplaced(((n, t) for n, t in hmt_tensors(method) if ".basis[" not in n), CUDA)
        projected = sum(s.projected for s in method.opt.slots)
        stats = cache.stats(0)
    assert len(cache.parked) == projected, f"{len(cache.parked)} parked bases for {projected} projected weights"
    assert not bad, "tensors off their device:\n" + "\n".join(bad)
    assert stats["cache/h2d_bytes"] > 0 and stats["cache/d2h_bytes"] > 0, stats


# --------------------------------------------------------------------------------------------- activation codecs
CODECS = ("int8", "fp8", "int4_outlier", "int8_outlier")


def _codec_round_trip(codec: str, dtype: torch.dtype) -> list[str]:
    from hmt_core.activations import codecs

    x = torch.randn(3, 40, 64, dtype=dtype, device=CUDA)  # (batch, seq, channels), numel not a block multiple
    packed = codecs.encode(x, codec, block=96)
    out = codecs.decode(packed)
    bad = misplaced(((f"{codec}.packed[{i}]", t) for i, t in enumerate(packed.tensors)), CUDA)
    bad += misplaced(iter([(f"{codec}.decoded", out)]), CUDA)
    if (out.shape, out.dtype) != (x.shape, x.dtype):
        bad.append(f"{codec}: decoded {tuple(out.shape)} {out.dtype}, expected {tuple(x.shape)} {x.dtype}")
    return bad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", CODECS)
def test_codec_ops_stay_on_cuda(codec, dtype):
    """Through the registered custom ops (their fake implementations: what a traced or compiled step sees)."""
    with fake_cuda():
        bad = _codec_round_trip(codec, dtype)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("codec", CODECS)
def test_codec_pytorch_bodies_stay_on_cuda(codec, monkeypatch):
    """The PyTorch implementations themselves (what runs on CUDA under ``kernels=torch``), called instead of the
    custom ops' fake implementations."""
    from hmt_core import kernels
    from hmt_core.activations import codecs

    for name in ("int8_block_quant", "int8_block_dequant", "fp8_block_quant", "fp8_block_dequant",
                 "outlier_quant", "outlier_dequant"):
        monkeypatch.setattr(codecs, name, getattr(codecs, name)._init_fn)
    with kernels.using("torch"), fake_cuda():
        bad = _codec_round_trip(codec, torch.bfloat16)
    assert not bad, "\n".join(bad)


class _NoLaunch:
    """A Triton kernel whose launch does nothing: the wrapper's allocations and views are what is traced."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("codec", ("int8", "fp8"))
def test_triton_codec_wrappers_allocate_on_cuda(codec, monkeypatch):
    """``hmt_core.kernels.quant``'s host side (output buffers, the FP8 table, bit views) with the kernel launch
    stubbed: a fake tensor has no memory for a kernel to run on."""
    pytest.importorskip("triton")
    from hmt_core.kernels import quant

    monkeypatch.setattr(quant, "_block_quant_kernel", _NoLaunch())
    monkeypatch.setattr(quant, "_block_dequant_kernel", _NoLaunch())
    with fake_cuda():
        x = torch.randn(3, 40, 64, dtype=torch.bfloat16, device=CUDA)
        if codec == "int8":
            q, scale = quant.int8_block_quant(x, 96)
            out = quant.int8_block_dequant(q, scale, list(x.shape), x.dtype)
        else:
            q, scale = quant.fp8_block_quant(x, 96, "e4m3")
            out = quant.fp8_block_dequant(q, scale, list(x.shape), x.dtype)
        bad = misplaced(iter([("q", q), ("scale", scale), ("decoded", out)]), CUDA)
        bad += misplaced(((f"lut{k}", t) for k, t in quant._LUTS.items() if t.device.type == "cuda"), CUDA)
    assert not bad, "\n".join(bad)
    assert out.shape == x.shape and out.dtype == x.dtype


# ------------------------------------------------------------------------------------------------ loss and loop
def test_fused_loss_forward_stays_on_cuda():
    from hmt_core.fused_ce import causal_lm_loss

    with fake_cuda():
        model = tiny_model()
        ids = torch.randint(0, 256, (2, 16), device=CUDA)
        fused = causal_lm_loss(model, ids, chunk_tokens=8)  # 4 chunks of the 32 tokens
        plain = model(input_ids=ids, labels=ids).loss
    assert (fused.device, fused.shape, fused.dtype) == (CUDA, torch.Size([]), torch.float32), fused
    assert (plain.device, plain.shape) == (fused.device, fused.shape)


class StubMethod:
    """The ``Method`` calls ``train_step`` makes, recorded; the gradients it would consume are never made (the
    stand-in ``backward`` below does nothing)."""

    name = "stub"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start_micro_batch(self, index: int, count: int) -> None:
        self.calls.append(("micro", index, count))

    def step(self) -> None:
        self.calls.append(("step",))

    def zero_grad(self) -> None:
        self.calls.append(("zero_grad",))

    def state_tensors(self):
        return iter(())


@pytest.mark.parametrize("fused_ce", [True, False])
def test_train_step_accumulates_the_loss_on_cuda(fused_ce, monkeypatch):
    from experiments.loop import autocast_context, train_step

    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: None)
    method = StubMethod()
    with fake_cuda():
        model = tiny_model()
        micro = [torch.randint(0, 256, (2, 16), device=CUDA) for _ in range(3)]
        loss, norm = train_step(model, method, micro, meter=None, fused_ce=fused_ce, ce_chunk_tokens=8,
                                autocast=lambda: autocast_context(CUDA, True))
    assert (loss.device, loss.shape, loss.dtype) == (CUDA, torch.Size([]), torch.float32), loss
    assert norm is None
    assert method.calls == [("micro", 0, 3), ("micro", 1, 3), ("micro", 2, 3), ("step",), ("zero_grad",)]


# ----------------------------------------------------------------------------------------- activation policies
def _policies() -> dict[str, object]:
    from hmt_core.activations.policy import PRESETS, ActivationPolicy

    out = {name: p for name, p in PRESETS.items() if not p.is_identity()}
    out["offload+codecs"] = ActivationPolicy(attn_out="offload_cpu", mlp_intermediate="int4_outlier",
                                             attn_qkv="fp8", norm="int8_outlier")
    return out


@pytest.mark.parametrize("name", list(_policies()))
def test_activation_policy_forward_saves_on_the_intended_device(name, monkeypatch):
    """The forward of each activation preset (and a policy with every codec kind and host offload): what the
    pack hooks keep for backward stays on cuda:0, except offloaded tensors, which are host copies."""
    from hmt_core.activations import apply_policy
    from hmt_core.activations.apply import _State
    from hmt_core.activations.saved import Offloaded
    from hmt_core.activations.codecs import Packed
    from hmt_core.fused_ce import causal_lm_loss

    packed: list = []  # everything the pack hooks return (the state's own dedup cache is cleared after forward)
    real_pack_fn = _State.pack_fn

    def recording_pack_fn(self, component, action):
        pack = real_pack_fn(self, component, action)
        return lambda t: packed.append(pack(t)) or packed[-1]

    monkeypatch.setattr(_State, "pack_fn", recording_pack_fn)
    with fake_cuda():
        model = tiny_model()
        handle = apply_policy(model, _policies()[name])
        loss = causal_lm_loss(model, torch.randint(0, 256, (2, 16), device=CUDA), chunk_tokens=8)
        device_saved = [(f"packed[{i}].{j}", t) for i, v in enumerate(packed) if isinstance(v, Packed)
                        for j, t in enumerate(v.tensors)]
        device_saved += [(f"kept[{i}]", v) for i, v in enumerate(packed) if isinstance(v, Tensor)]
        host_saved = [(f"offloaded[{i}]", v.t) for i, v in enumerate(packed) if isinstance(v, Offloaded)]
        bad = misplaced(iter(device_saved + [("loss", loss)]), CUDA) + misplaced(iter(host_saved), CPU)
        handle.remove()
    assert packed, f"{name}: no pack hook ran"
    assert not bad, f"{name}: saved tensors off their device:\n" + "\n".join(bad)
    if name == "offload+codecs":
        codecs_used = {v.codec for v in packed if isinstance(v, Packed)}
        assert host_saved and codecs_used == {"fp8", "int4_outlier", "int8_outlier"}, (len(host_saved), codecs_used)


def test_a_checkpoint_of_implicit_kernels_resumes_fused_with_its_step_counters_on_the_device():
    """A checkpoint written before the kernel choice was explicit (``foreach=None``: torch keeps ``step`` on the
    host) resumed by a fused AdamW: torch places each ``step`` by the *saved* group options, so the driver writes
    the run's choice into them before loading; the fused kernel needs every state tensor on the device."""
    from baselines.driver import OptimizerDriver

    with fake_cuda():
        weight = nn.Parameter(torch.zeros(4, 4, device=CUDA))
        old = torch.optim.AdamW([weight], lr=1e-3)  # implicit kernels, as before method.impl
        weight.grad = torch.ones_like(weight)
        old.step()
        saved = {"optimizer": old.state_dict(), "base_lrs": [1e-3]}
        driver = OptimizerDriver(torch.optim.AdamW([weight], lr=1e-3, fused=True), max_grad_norm=None)
        driver.load_state_dict(saved)
        state = driver.optimizer.state[weight]
        group = driver.optimizer.param_groups[0]
        placed = {key: value.device for key, value in state.items()}
    assert old.state_dict()["state"][0]["step"].device == CPU, "the old checkpoint's counter was on the host"
    assert group["fused"] is True and group["foreach"] is None, group
    assert placed == {"step": CUDA, "exp_avg": CUDA, "exp_avg_sq": CUDA}, placed


def test_the_codecs_divide_cuda_tensors_by_device_tensors_never_by_a_cpu_scalar():
    """ATen's CUDA division by a CPU scalar (a Python number, or a 0-dim CPU tensor) multiplies by its reciprocal
    (``div_true_kernel_cuda``), which rounds differently from the Triton kernels' ``div_rn``: on an H200 every codec
    case then differed from its kernel. Every division of a CUDA tensor in the codecs' PyTorch paths must take a
    divisor on the device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hmt_core import kernels
    from hmt_core.activations import codecs
    from hmt_core.int8_weights import codec as weight_codec

    divisions = {torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor, torch.ops.aten.div.Scalar,
                 torch.ops.aten.div_.Scalar}
    found: list[str] = []

    class CpuScalarDivisors(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in divisions and isinstance(args[0], Tensor) and args[0].device.type == "cuda":
                d = args[1]
                if not isinstance(d, Tensor) or (d.dim() == 0 and d.device.type == "cpu"):
                    found.append(f"{func} by {d!r}")
            return func(*args, **(kwargs or {}))

    with fake_cuda(), kernels.using("torch"):
        x = torch.randn(16, 300, device=CUDA)
        with CpuScalarDivisors():
            for op, args in ((codecs.int8_block_quant, (64,)), (codecs.fp8_block_quant, (64, "e4m3")),
                             (codecs.outlier_quant, (4, 64, 3.0, 2)), (codecs.outlier_quant, (8, 64, 3.0, 2))):
                op._init_fn(x, *args)  # the custom op's body: a dispatch mode sees only the op itself otherwise
            weight_codec.quantize(x, 64)
    assert not found, "CUDA divisions by a CPU scalar:\n" + "\n".join(found)


def test_an_int8_model_built_on_meta_reaches_cuda_as_int8():
    """HMT with INT8 weights and tables on CUDA: built on meta, each module made, initialised and quantized on the
    device in turn (``experiments.dist.parallel.quantizes_onto``), so no full-precision projected weight or table
    ever sits on the device whole; then trained there. Every tensor ends on CUDA (none on meta or the host), and
    each INT8 layer's phantom weight stays a stride-0 view (moving the rest must not materialize it)."""
    from experiments.config import ModelConfig
    from experiments.dist.parallel import build_sharded, quantizes_onto
    from hmt_core.int8_weights import int8_layers

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=176, vocab_size=256,
                      max_position_embeddings=128, dtype="bf16")
    with fake_cuda():
        method = HMT["hmt-int8-weights"]()
        method = type(method)(dataclasses.replace(method.config, embedding_dtype="int8",
                                                  target_patterns=("attn", "mlp", "lm_head")))
        runner_device = torch.device("cuda")  # as experiments.run passes it: no index, the tensors land on cuda:0
        assert quantizes_onto(method, runner_device) and not quantizes_onto(method, CPU)
        model = build_sharded(cfg, method, None, vocab_size=256, device=runner_device)
        layers = int8_layers(model)
        phantoms = [m.weight.stride() for m in layers]
        drive(method, model)
        bad = misplaced(model_tensors(model), CUDA) + misplaced(hmt_tensors(method), CUDA)
    assert len(layers) == 2 * 7 + 1, len(layers)  # q, k, v, o, gate, up, down per layer + the LM head
    assert all(s == (0, 0) for s in phantoms), phantoms
    assert not bad, "tensors off cuda:0:\n" + "\n".join(bad)
