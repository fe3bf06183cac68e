"""Weight streaming (``method.weight_offload=host``, hmt_core.streaming) on fake CUDA tensors (the fake-CUDA tier,
docs/testing.md): placement and stream use. A forward holds at most the working layers' weights on ``cuda:0`` (the
layer computing and the one prefetched), the rest have no device storage and their host copies are CPU tensors;
every host-to-device copy of a weight is issued on the streamer's copy-in stream and every write-back on its
copy-out stream, asynchronously, and the compute stream waits for a copy's event before the layer reads it; a
step never synchronizes with the host. ``backward()`` cannot run here, so the backward is driven by hand layer by
layer, last first: the pre-backward fetch (what the multi-grad hook on the layer's output calls), then each
weight's fake ``.grad`` and its post-accumulate-grad hooks (HMT's update, then the streamer's write-back).

Needs the CUDA build of torch; skipped on the CPU build."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if torch.version.cuda is None:
    pytest.skip("fake-CUDA tier: needs the CUDA build of torch (docs/testing.md)", allow_module_level=True)
pytestmark = pytest.mark.fake_cuda

from benchmarks import fake_cuda as fake_cuda_tier  # noqa: E402
from benchmarks.fake_cuda import fake_cuda  # noqa: E402

CUDA = torch.device("cuda", 0)
COMPUTE = "compute"


class Streams:
    """Recording stand-ins for what needs the CUDA driver: streams, events, the current stream, ``record_stream``
    and every synchronization (which a step must not call)."""

    def __init__(self) -> None:
        self.current: list[object] = [COMPUTE]
        self.log: list[tuple] = []  # ("wait", stream, event) | ("record", stream, event) | ("record_stream", ...)
        self.syncs: list[str] = []
        streams = self

        class Stream:
            def __init__(self, *args, **kwargs) -> None:
                self.name = f"side{id(self) % 10_000}"

            def wait_event(self, event) -> None:
                streams.log.append(("wait", self.name, event))

            def synchronize(self) -> None:
                streams.syncs.append(f"{self.name}.synchronize")

        class Event:
            def record(self, stream=None) -> None:
                streams.log.append(("record", getattr(stream, "name", stream), self))

            def synchronize(self) -> None:
                streams.syncs.append("event.synchronize")

        class Current:
            name = COMPUTE

            def wait_event(self, event) -> None:
                streams.log.append(("wait", COMPUTE, event))

        self.Stream, self.Event, self.Current = Stream, Event, Current

    @contextlib.contextmanager
    def stream(self, s) -> Iterator[None]:
        self.current.append(s.name)
        try:
            yield
        finally:
            self.current.pop()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        patches = [(torch.cuda, "Stream", self.Stream), (torch.cuda, "Event", self.Event),
                   (torch.cuda, "stream", self.stream), (torch.cuda, "current_stream", lambda device=None: self.Current()),
                   (torch.cuda, "synchronize", lambda device=None: self.syncs.append("torch.cuda.synchronize")),
                   (torch.Tensor, "record_stream", lambda t, s: self.log.append(("record_stream", s.name, t.shape)))]
        with contextlib.ExitStack() as stack:
            for owner, name, value in patches:
                stack.enter_context(mock.patch.object(owner, name, value))
            yield


class Copies(TorchDispatchMode):
    """Every cross-device ``copy_``: (direction, stream it was issued on, non_blocking, shape)."""

    def __init__(self, streams: Streams) -> None:
        super().__init__()
        self.streams, self.seen = streams, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and args[0].device != args[1].device:
            direction = "h2d" if args[0].device.type == "cuda" else "d2h"
            self.seen.append((direction, self.streams.current[-1], bool(args[2] if len(args) > 2 else
                                                                         kwargs.get("non_blocking", False)),
                              tuple(args[0].shape)))
        return func(*args, **kwargs)


@pytest.fixture(params=["bf16", "int8"])
def streamed(request):
    """A tiny bf16 Llama (3 layers) on fake CUDA with HMT ``weight_offload=host`` attached, recording streams; its
    projected weights BF16, or INT8 (``method.weight_dtype=int8``: codes and scales streamed)."""
    from experiments import methods
    from experiments.config import ModelConfig
    from experiments.models import build_model

    streams = Streams()
    with fake_cuda_tier.driver_stand_ins(), streams.installed(), fake_cuda() as mode:
        cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, intermediate_size=176, vocab_size=256,
                          max_position_embeddings=128, dtype="bf16")
        model = build_model(cfg, device="cuda")
        method = methods.make_method(methods.make_config({"name": "hmt", "mode": "B", "rank": 8,
                                                          "weight_offload": "host", "weight_dtype": request.param}))
        model = method.prepare(model)
        method.attach(model, max_grad_norm=1.0)
        yield model, method, streams, mode


def _grad_leaf(slot):
    """The parameter autograd accumulates a slot's gradient into: the weight, or an INT8 weight's phantom."""
    return slot.param.layer.weight if hasattr(slot.param, "stored_tensors") else slot.param


def _on_device(method) -> list[int]:
    return [i for i, layer in enumerate(method.streamer.layers)
            if any(w.param.untyped_storage().nbytes() for w in layer)]


def test_forward_holds_only_the_working_layers_and_copies_in_on_the_side_stream(streamed):
    model, method, streams, mode = streamed
    streamer, layers = method.streamer, method.streamer.layers
    assert _on_device(method) == [] and streamer.resident_bytes == 0
    assert all(w.param.device == CUDA and w.host.device.type == "cpu" for w in streamer.weights())
    seen = {}
    for i, layer in enumerate(model.model.layers):  # after the streamer's pre-hook: what the layer runs with
        layer.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, _on_device(method)))
    copies = Copies(streams)
    with copies:
        model(input_ids=torch.randint(0, 256, (2, 16), device="cuda"))
    assert seen == {0: [0, 1], 1: [1, 2], 2: [2]}, seen  # layer i and the prefetched i + 1, nothing else
    assert _on_device(method) == [2]  # the last layer of a forward with a graph: its backward comes first
    weights = [c for c in copies.seen if c[3] in {tuple(w.param.shape) for w in streamer.weights()}]
    assert len(weights) == sum(len(layer) for layer in layers)  # each weight copied in once
    assert all(d == "h2d" and s == streamer.h2d.name and nb for d, s, nb, _ in weights), weights
    readies = [e for kind, s, e in streams.log if kind == "record" and s == streamer.h2d.name]
    waited = [e for kind, s, e in streams.log if kind == "wait" and s == COMPUTE]
    assert readies and all(e in waited for e in readies)  # the compute stream waits for each copy-in
    assert not streams.syncs and not mode.assumed


def test_backward_by_hand_updates_on_the_device_and_writes_back_on_the_copy_out_stream(streamed):
    model, method, streams, mode = streamed
    streamer = method.streamer
    layer_of = {id(_grad_leaf(w.slot)): i for i, layer in enumerate(streamer.layers) for w in layer}
    stored_of = {id(_grad_leaf(w.slot)): [] for w in streamer.weights()}
    for w in streamer.weights():
        stored_of[id(_grad_leaf(w.slot))].append(w.param)
    copies = Copies(streams)
    for step in range(2):
        with copies:
            model(input_ids=torch.randint(0, 256, (2, 16), device="cuda"))
            method.start_micro_batch(0, 1)
            fetched = set()
            for p in reversed([p for p in model.parameters() if p.requires_grad]):
                i = layer_of.get(id(p))
                if i is not None and i not in fetched:  # the pre-backward hook on layer i's output
                    streamer.fetch_layer(i, prefetch=i - 1)
                    fetched.add(i)
                    assert _on_device(method) in ([i], [i - 1, i]), (i, _on_device(method))
                p.grad = torch.randn(p.shape, dtype=p.dtype, device=p.device)
                for hook in list(p._post_accumulate_grad_hooks.values()):
                    hook(p)
                if i is not None:  # Mode B: updated in HMT's hook, then written back and freed
                    assert p.grad is None and not any(t.untyped_storage().nbytes() for t in stored_of[id(p)])
            method.step()
            method.zero_grad()
        assert _on_device(method) == [] and streamer.resident_bytes == 0, step
    n = sum(len(layer) for layer in streamer.layers)
    back = [c for c in copies.seen if c[0] == "d2h"]
    assert len(back) == 2 * n and all(s == streamer.d2h.name and nb for _, s, nb, _ in back), back
    kept = [e for e in streams.log if e[0] == "record_stream"]
    assert len(kept) == 2 * n and all(s == streamer.d2h.name for _, s, _ in kept)  # no reuse before the copy
    assert all(s.m.device == CUDA for s in method.opt.slots if s.projected and s.m is not None)
    assert not streams.syncs and not mode.assumed


@pytest.mark.parametrize("weight_dtype", ["bf16", "int8"])
def test_a_streamed_model_is_built_on_the_host_never_whole_on_the_device(weight_dtype):
    # experiments.dist.build_sharded on CUDA with weight_offload=host: built on meta, each decoder module made on
    # the device and its projected weights copied to pinned host memory and freed before the next module is made
    # (hmt_core.host_weights), so the device never holds more than the resident part or one module
    from experiments import methods
    from experiments.config import ModelConfig
    from experiments.dist import parallel
    from experiments.memory.meter import MemoryMeter
    from hmt_core import streaming

    cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, intermediate_size=176, vocab_size=256,
                      max_position_embeddings=128, dtype="bf16")
    method = methods.make_method(methods.make_config({"name": "hmt", "mode": "B", "rank": 8,
                                                      "weight_offload": "host", "weight_dtype": weight_dtype}))
    pinned = []
    real_empty = torch.empty

    def empty(*args, **kwargs):  # pinned host copies (pin_memory needs the driver: recorded, then dropped)
        if kwargs.pop("pin_memory", False):
            pinned.append(args[0] if args else kwargs.get("size"))
        return real_empty(*args, **kwargs)

    with fake_cuda_tier.driver_stand_ins(), Streams().installed(), fake_cuda(), \
            mock.patch.object(torch, "empty", empty):
        with MemoryMeter(source="tracker", device=CUDA) as meter:  # host tensors counted apart
            model = parallel.build_sharded(cfg, method, None, vocab_size=None, device=CUDA)
            peak = meter.report().peak_bytes
        method.attach(model, max_grad_norm=1.0)  # the streamer adopts the host copies: nothing copied again
    layers = streaming.decoder_layers(model)
    stored = ("proj.weight_codes", "proj.weight_scales") if weight_dtype == "int8" else ("proj.weight",)
    streamed = [p for layer in layers for name, p in layer.named_parameters() if name.endswith(stored)]
    assert len(streamed) == 3 * 7 * len(stored) and len(pinned) == len(streamed), (len(streamed), len(pinned))
    assert all(p.device == CUDA and p.untyped_storage().nbytes() == 0 for p in streamed)
    layer_bytes = 2 * (4 * 64 * 64 + 3 * 64 * 176)  # one layer's BF16 projections: 100,352 bytes
    largest = 2 * 64 * 176  # the largest BF16 weight (gate, up, down): 22,528 bytes
    resident = sum(p.untyped_storage().nbytes() for p in model.parameters())  # embedding, head, norms
    # the streamed modules are made (and freed) before the resident part is placed: the peak is the resident part
    # (66,432 bytes here) plus a few bytes of temporaries, well under it plus one layer's weights; an INT8 module
    # is made in BF16 and quantized on the device, so its codes and scales and the quantizer's temporaries join
    # it (measured: 25,782 bytes over the resident part), still under the BF16 weight twice
    made = largest * (2 if weight_dtype == "int8" else 1)
    assert resident <= peak < resident + made < resident + layer_bytes, (peak, resident, made, layer_bytes)
    assert method.streamer.resident_bytes == 0 and method.streamer.h2d_bytes == 0
    assert all(w.host.device.type == "cpu" for w in method.streamer.weights())
