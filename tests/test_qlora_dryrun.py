"""QLoRA in a dry run: the fake NF4 storage is bitsandbytes' storage tensor for tensor, the forward's 4-bit matmul
runs bitsandbytes' own arithmetic with its weight-sized temporary visible to the meter, and FakeTensorMode peaks
equal the real-tensor tracker's on the tiny model and on 125M widths (2 layers)."""

import math

import bitsandbytes as bnb
import pytest
import torch
from test_dryrun import _run_config
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from baselines import nf4
from experiments import methods
from experiments.dryrun import trace_steps
from experiments.memory.meter import MemoryMeter
from hmt_core.state_bytes import iter_state_tensors


def _quant_tensors(param) -> list[tuple[str, tuple, torch.dtype]]:
    """(path, shape, dtype) of a quantized weight and of every tensor of its ``quant_state``, in a fixed order."""
    qs = param.quant_state
    out = [("weight", tuple(param.shape), param.dtype)]
    for name in ("absmax", "code", "offset"):
        t = getattr(qs, name)
        if t is not None:
            out.append((name, tuple(t.shape), t.dtype))
    if qs.state2 is not None:
        out += [(f"state2.{n}", tuple(getattr(qs.state2, n).shape), getattr(qs.state2, n).dtype)
                for n in ("absmax", "code")]
    return out


@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "fp32_absmax"])
@pytest.mark.parametrize("shape", [(176, 64), (100, 30), (1024, 768)])
def test_fake_nf4_storage_is_bitsandbytes_storage(shape, double_quant):
    """Same tensors (shape, dtype) as ``Params4bit(w).to("cpu")``, same scalar metadata, and the bytes QLoRA's
    layout gives: n/2 packed codes, one absmax per 64 weights (1 byte with double quantization + an fp32 absmax per
    256 of them, the offset and the 256-entry map; else 4 bytes), the 16-entry NF4 map."""
    w = torch.randn(*shape, dtype=torch.bfloat16)
    real = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=double_quant, quant_type="nf4").to("cpu")
    with FakeTensorMode() as mode:
        fake = nf4.fake_params4bit(mode.from_tensor(w), double_quant=double_quant)
    assert _quant_tensors(fake) == _quant_tensors(real)
    for attr in ("blocksize", "quant_type", "compress_statistics", "quant_storage", "bnb_quantized", "requires_grad"):
        assert getattr(fake, attr) == getattr(real, attr), attr
    for attr in ("shape", "dtype", "blocksize", "quant_type", "nested"):
        assert getattr(fake.quant_state, attr) == getattr(real.quant_state, attr), attr
    n, blocks = w.numel(), math.ceil(w.numel() / 64)
    expected = math.ceil(n / 2) + 16 * 4 + (blocks + 4 + 4 * math.ceil(blocks / 256) + 256 * 4 if double_quant
                                           else 4 * blocks)
    nbytes = sum(t.numel() * t.element_size() for t in [fake, *iter_state_tensors(fake.quant_state)])
    assert nbytes == expected, (nbytes, expected)


def test_real_weights_are_refused_by_the_fake_stand_in():
    with pytest.raises(ValueError, match="stand-in"):
        nf4.fake_params4bit(torch.randn(8, 64), double_quant=True)


def _linear(cls, w: torch.Tensor, double_quant: bool):
    out_f, in_f = w.shape
    lin = cls(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, compress_statistics=double_quant,
              quant_type="nf4", device="meta")
    lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, compress_statistics=double_quant, quant_type="nf4")
    lin = lin.to("cpu")
    lin.support_avx512bf16_for_cpu = False  # as baselines.qlora sets it: one layout for train and eval
    return lin


@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "fp32_absmax"])
def test_visible_matmul_is_bitsandbytes_arithmetic_and_shows_the_dequantized_weight(double_quant):
    """``nf4.Linear4bit`` gives bitsandbytes' ``Linear4bit`` output and input gradient bitwise (it runs the kernel
    the op dispatches to on CPU), and the meter's forward peak grows by exactly the temporaries of that kernel: the
    dequantized BF16 weight (2 bytes per element) and, with double quantization, the fp32 absmax it was scaled by
    (4 bytes per 64 weights), which the fused op hid."""
    torch.manual_seed(0)
    w = torch.randn(176, 64, dtype=torch.bfloat16)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    results = {}
    for cls in (bnb.nn.Linear4bit, nf4.Linear4bit):
        lin, xi = _linear(cls, w, double_quant), x.clone().requires_grad_(True)
        meter = MemoryMeter()
        meter.track([xi], "other")
        with meter, meter.phase("forward"):
            y = lin(xi)
        y.float().square().sum().backward()
        results[cls] = (y.detach(), xi.grad, meter.report().peak_bytes)
    (y0, g0, peak0), (y1, g1, peak1) = results[bnb.nn.Linear4bit], results[nf4.Linear4bit]
    assert torch.equal(y0, y1) and torch.equal(g0, g1)
    n = w.numel()
    assert peak1 - peak0 == 2 * n + (4 * math.ceil(n / 64) if double_quant else 0), (peak0, peak1)


CASES = {
    "tiny": ["model=tiny", "train.seq_len=64", "train.batch_size=2"],
    "tiny-fp32_absmax-adamw8bit": ["model=tiny", "train.seq_len=64", "train.batch_size=2",
                                   "method.double_quant=false", "method.optimizer=adamw8bit"],
    "125m-width": ["model=125m", "model.num_layers=2", "train.seq_len=64", "train.batch_size=1"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_dryrun_equals_real_tracker_within_one_percent(name):
    """Two QLoRA steps on real CPU tensors and on fake ones (``experiments.dryrun.trace_steps``): peak, per-phase
    peaks and categories within 1% (they are equal to the byte here), the same NF4 storage in ``params`` (codes and
    block constants, the fp32 weights left unquantized, the LoRA adapters), and no assumed values but the entries
    of the 8-bit optimizer's quantization maps."""
    _, run = _run_config("method=qlora", *CASES[name])
    real = trace_steps(run, methods.make_method(run.method), fake=False)
    fake = trace_steps(run, methods.make_method(run.method), fake=True)
    r, f = real["report"], fake["report"]
    assert f.peak_bytes == pytest.approx(r.peak_bytes, rel=0.01), (f.peak_bytes, r.peak_bytes)
    for phase, value in r.peak_by_phase_bytes.items():
        assert f.peak_by_phase_bytes[phase] == pytest.approx(value, rel=0.01), phase
    for key, value in r.peak_by_category_bytes.items():
        assert f.peak_by_category_bytes[key] == pytest.approx(value, rel=0.01, abs=64), key
    assert f.peak_by_category_bytes["params"] == r.peak_by_category_bytes["params"]
    if "method.optimizer=adamw8bit" in CASES[name]:  # only the entries of bitsandbytes' 8-bit maps (.tolist())
        assert all(site.startswith("bitsandbytes/functional.py") for site in fake["assumed_scalars"])
    else:
        assert fake["assumed_scalars"] == {}
    assert (fake["params_total"], fake["params_trainable"]) == (real["params_total"], real["params_trainable"])
    assert fake["method_summary"]["quantized_linear_layers"] == real["method_summary"]["quantized_linear_layers"] > 0


def test_dryrun_leaves_bitsandbytes_usable_on_real_tensors():
    """A dry run must not leave fake tensors in bitsandbytes' module-level caches (its 8-bit dynamic map, used by
    double quantization): a real weight quantized after one dequantizes exactly as one quantized before."""
    w = torch.randn(64, 64, dtype=torch.bfloat16)

    def roundtrip() -> torch.Tensor:
        p = bnb.nn.Params4bit(w.clone(), requires_grad=False, compress_statistics=True, quant_type="nf4").to("cpu")
        return bnb.functional.dequantize_4bit(p.data, p.quant_state)

    before = roundtrip()
    _, run = _run_config("method=qlora", "model=tiny", "model.num_layers=1", "train.seq_len=32", "train.batch_size=1",
                         "dryrun.steps=1")
    trace_steps(run, methods.make_method(run.method), fake=True)
    after = roundtrip()
    assert not is_fake(after) and torch.equal(after, before)
