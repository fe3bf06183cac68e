"""Weight streaming (``method.weight_offload=host``): the decoder layers' projected weights (BF16, or INT8 codes and
scales: ``method.weight_dtype=int8``) live in host memory (pinned on CUDA) and are on the device only while their
layer computes; HMT's per-layer update runs on the device inside backward and the updated weight goes back to the
host. Design notes: docs/weight_streaming.md.

Mechanism (FSDP2's, without the sharding: ``torch.distributed.fsdp._fully_shard._fsdp_param.free_storage`` /
``alloc_storage``): each streamed ``nn.Parameter`` stays the same device tensor all along (autograd, the optimizer's
slots, the hooks and the saved ``weight.t()`` views keep referring to it), but its storage is resized to 0 bytes
while it is released and grown back and filled from the host copy when it is fetched. The copies go through
``.data`` (a fresh version counter), so refilling a weight that autograd saved for backward is not an in-place
change in autograd's eyes, and the values refilled are the ones saved.

Per decoder layer (the longest ``nn.ModuleList``, as FSDP2 wraps):
* forward pre-hook: layer i fetched (its copy waited for), layer i + 1 prefetched;
* forward hook: layer i released (no write-back: forward does not change weights), except the last layer of a
  forward that records a graph, whose backward comes first; a pre-backward hook (``register_multi_grad_hook`` on
  the layer's outputs, FSDP2's trigger) fetches layer i again and prefetches layer i − 1;
* each weight's post-accumulate-grad hook, registered after HMT's (so it runs after the update): the weight (an
  INT8 weight's codes and scales, which the update rewrites) is written back to the host when an update was
  applied (the slot has no pending low-rank gradient and no accumulated ``.grad``), then released. An update deferred to ``finish_step`` (Mode A under clipping) fetches the
  weight again in ``write_low_rank`` and writes it back the same way.

On CUDA the host-to-device copies run on one side stream and the device-to-host copies on another, ordered by CUDA
events (no host synchronization in a step); a device block is allocated on the compute stream, and a block being
copied back is kept from reuse by ``record_stream`` until the copy is done. On the CPU the same code runs with
synchronous copies (the host copy is a second CPU tensor), so a streamed run equals the resident one bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from hmt_core import host_weights
from hmt_core.precision import is_quantized

OFFLOADS = ("none", "host")

_STREAMED = WeakIdKeyDictionary()  # nn.Parameter -> (WeightStreamer, _Weight), by identity (readable/writable)
_OBSERVERS: list[Callable[[torch.UntypedStorage, torch.device], None]] = []  # the memory meter's storage_resized


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the longest ``nn.ModuleList`` in the model (``model.layers``, ``transformer.h``)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


@dataclass(eq=False)
class _Weight:
    name: str
    param: nn.Parameter  # the device tensor holding values (a weight, an INT8 weight's codes or scales); its
    # storage is empty while released
    host: Tensor  # the current values between uses (pinned on CUDA)
    layer: int
    slot: Any  # the optimizer's slot: whether an update was applied in the hook
    on_device: bool = True
    ready: Any = None  # CUDA event: the host-to-device copy is done (None: nothing to wait for)
    stored: Any = None  # CUDA event: the device-to-host copy is done (the host copy may be read)

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()


def resize_storage(p: Tensor, nbytes: int) -> None:
    """``p``'s storage grown or freed (FSDP2's ``alloc_storage`` / ``free_storage``), the observers told."""
    storage = p.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
        for observe in _OBSERVERS:
            observe(storage, p.device)


class observe_resizes:  # noqa: N801 - a context manager used like a function
    """While inside, ``callback(storage, device)`` hears of every storage the streamer grows or frees (the memory
    meter's ``storage_resized``: a resize dispatches no ATen op and the storage object lives on)."""

    def __init__(self, callback: Callable[[torch.UntypedStorage, torch.device], None]) -> None:
        self.callback = callback

    def __enter__(self) -> None:
        _OBSERVERS.append(self.callback)

    def __exit__(self, *exc) -> None:
        _OBSERVERS.remove(self.callback)


def config_error(*, per_layer: bool, master_weights: bool) -> str | None:
    """Why ``method.weight_offload=host`` cannot be combined with these keys, or None."""
    if not per_layer:
        return "it streams each layer around its update inside backward: method.per_layer=false has none"
    if master_weights:
        return "method.master_weights=true keeps an fp32 copy of every weight on the device"
    return None


@dataclass(eq=False)
class WeightStreamer:
    """The streamed weights of ``model`` and the hooks that move them (``install``)."""

    device: torch.device
    layers: list[list[_Weight]]  # by decoder layer, forward order
    h2d_bytes: int = 0  # issued copies (host counters: no synchronization)
    d2h_bytes: int = 0
    resident_bytes: int = 0  # streamed weights with device storage now, and the most there were at once
    peak_resident_bytes: int = 0
    handles: list = field(default_factory=list)
    restore: Callable[[], None] | None = None  # undoes the optimizer's deferred-write wrapper
    sweep_queued: bool = False  # ``release_all`` queued for the end of the running backward

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None

    # ---- moving one weight -----------------------------------------------------------------------------------
    def _after(self, stream: Any) -> None:  # ``stream`` waits for the work queued on the compute stream so far
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        stream.wait_event(event)

    def fetch(self, w: _Weight) -> None:
        """Start bringing ``w`` to the device (a no-op when it is there or arriving)."""
        if w.on_device:
            return
        resize_storage(w.param, w.nbytes)  # allocated on the compute stream, in its order
        self.h2d_bytes += w.nbytes
        self.resident_bytes += w.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        w.on_device = True
        if not self.cuda:
            w.param.data.copy_(w.host)
            return
        self._after(self.h2d)  # the block may have served kernels queued before
        if w.stored is not None:
            self.h2d.wait_event(w.stored)  # the host copy is being written back
        with torch.cuda.stream(self.h2d):
            w.param.data.copy_(w.host, non_blocking=True)
            w.ready = torch.cuda.Event()
            w.ready.record(self.h2d)

    def wait(self, w: _Weight) -> None:
        """The compute stream may read ``w`` from here on."""
        self.fetch(w)
        if w.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(w.ready)
            w.ready = None

    def release(self, w: _Weight, *, write_back: bool) -> None:
        """Free ``w``'s device storage, after copying it to the host when its values changed."""
        if not w.on_device:
            return
        if write_back:
            self.d2h_bytes += w.nbytes
            if not self.cuda:
                w.host.copy_(w.param.data)
            else:
                self._after(self.d2h)
                with torch.cuda.stream(self.d2h):
                    w.host.copy_(w.param.data, non_blocking=True)
                    w.stored = torch.cuda.Event()
                    w.stored.record(self.d2h)
                w.param.data.record_stream(self.d2h)  # the block is not reused before the copy is done
        elif w.ready is not None:  # released before its copy was waited for (a prefetch not used)
            torch.cuda.current_stream(self.device).wait_event(w.ready)
            w.ready = None
        resize_storage(w.param, 0)
        w.on_device = False
        self.resident_bytes -= w.nbytes

    # ---- layers ---------------------------------------------------------------------------------------------
    def fetch_layer(self, i: int, *, prefetch: int | None) -> None:
        for w in self.layers[i]:
            self.wait(w)
        if prefetch is not None and 0 <= prefetch < len(self.layers):
            for w in self.layers[prefetch]:
                self.fetch(w)

    def release_layer(self, i: int) -> None:
        for w in self.layers[i]:
            self.release(w, write_back=False)

    def backward_reached(self, i: int) -> None:
        """Backward reached layer i's output: fetch it, prefetch i - 1, free layer i + 1 (its backward is done and
        its gradients accumulated: autograd runs a ready AccumulateGrad first; what is still there got no gradient,
        so no update) and, once per backward, sweep at its end."""
        if not self.sweep_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.release_all)
            self.sweep_queued = True
        if i + 1 < len(self.layers):
            self.release_layer(i + 1)
        self.fetch_layer(i, prefetch=i - 1)

    def release_all(self) -> None:
        """At the end of a backward: a weight still on the device got no gradient there (``torch.autograd.grad``,
        as the activation probe takes, fires no post-accumulate-grad hook; a weight the loss does not reach) and so
        no update: freed without write-back (an updated weight was written back and freed in its hook)."""
        self.sweep_queued = False
        for w in self.weights():
            self.release(w, write_back=False)

    def weights(self) -> Iterator[_Weight]:
        for layer in self.layers:
            yield from layer

    def by_slot(self) -> list[list[_Weight]]:
        """The streamed tensors grouped by the optimizer slot they belong to (an INT8 weight: codes and scales)."""
        groups: dict[int, list[_Weight]] = {}
        for w in self.weights():
            groups.setdefault(id(w.slot), []).append(w)
        return list(groups.values())

    def host_bytes(self) -> int:
        return sum(w.host.numel() * w.host.element_size() for w in self.weights())

    def synchronize(self) -> None:
        """Every write-back done (the host copies may be read): for checkpoints and exports, never in a step."""
        if self.cuda:
            self.d2h.synchronize()

    def stats(self) -> dict[str, float]:
        return {"stream/h2d_bytes": float(self.h2d_bytes), "stream/d2h_bytes": float(self.d2h_bytes),
                "stream/host_bytes": float(self.host_bytes()),
                "stream/device_bytes_peak": float(self.peak_resident_bytes),
                "stream/weights": float(sum(len(layer) for layer in self.layers))}

    def remove(self) -> None:
        """Hooks removed, every weight back on the device for good (its host copy's values)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.restore is not None:
            self.restore()
        self.synchronize()
        for w in self.weights():
            self.wait(w)
            _STREAMED.pop(w.param, None)


def _outputs(output: Any) -> list[Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _layer_hooks(streamer: WeightStreamer, i: int, last: int) -> tuple[Callable, Callable]:
    def pre(module: nn.Module, args: Any) -> None:
        # a recompute inside backward (activation checkpointing) runs after the pre-backward fetch: no prefetch
        streamer.fetch_layer(i, prefetch=None if _in_backward() else i + 1)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if _in_backward():  # a recompute: the layer's backward (and updates) follow
            return
        outputs = _outputs(output)
        if torch.is_grad_enabled() and outputs:
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grad: streamer.backward_reached(i), mode="any")
            if i == last:  # its backward comes first
                return
        streamer.release_layer(i)

    return pre, post


def _after_grad(streamer: WeightStreamer, slot: Any, stored: list[_Weight]) -> Callable[[Tensor], None]:
    def hook(param: Any) -> None:  # after HMT's: an update applied leaves no pending Ĝ and no .grad
        updated = slot.pending is None and param.grad is None
        for w in stored:
            streamer.release(w, write_back=updated)

    return hook


def stored_tensors(param: Any) -> list[Tensor]:
    """The tensors that hold a weight's values, which streaming moves: the weight itself, or an INT8 weight's codes
    and scales (``param`` its optimizer handle, ``hmt_core.int8_weights.Int8Weight``)."""
    return list(param.stored_tensors()) if is_quantized(param) else [param]


def _wrap_deferred_writes(streamer: WeightStreamer, opt: Any) -> Callable[[], None]:
    """``opt.write_low_rank`` fetches a released weight first and writes it back after (Mode A's update deferred
    to ``finish_step`` by clipping); an in-hook write finds its weight on the device and leaves it there."""
    by_slot = {id(stored[0].slot): stored for stored in streamer.by_slot()}
    original = opt.write_low_rank

    def write_low_rank(s: Any, direction: Tensor, step_size: float) -> None:
        stored = by_slot.get(id(s), [])
        if not stored or all(w.on_device for w in stored):
            return original(s, direction, step_size)
        for w in stored:
            streamer.wait(w)
        original(s, direction, step_size)
        for w in stored:
            streamer.release(w, write_back=True)

    opt.write_low_rank = write_low_rank
    return lambda: opt.__dict__.pop("write_low_rank", None)


@torch.no_grad()
def install(model: nn.Module, opt: Any) -> WeightStreamer:
    """Stream the projected weights (``opt``'s projected slots) that sit in ``model``'s decoder layers: host copies
    made, device storages freed, hooks registered. Call after the optimizer's own hooks (they must run first)."""
    owner = {id(t): s for s in opt.slots if s.projected for t in stored_tensors(s.param)}
    layers = decoder_layers(model)
    groups = [[_Weight(owner[id(p)].name, p, None, i, owner[id(p)]) for p in layer.parameters() if id(p) in owner]
              for i, layer in enumerate(layers)]
    if not any(groups):
        raise ValueError("method.weight_offload=host: no projected weight sits in a decoder layer (the longest "
                         "nn.ModuleList) of this model")
    device = next(w.param.device for g in groups for w in g)
    streamer = WeightStreamer(device=device, layers=groups)
    for w in streamer.weights():
        _STREAMED[w.param] = (streamer, w)
        w.host = host_weights.take(w.param)  # placed on the host at prepare: never whole on the device
        if w.host is None:
            w.host = host_weights.host_copy(w.param, pinned=streamer.cuda)
            streamer.resident_bytes += w.nbytes
            streamer.release(w, write_back=False)
        else:
            w.on_device = False
    host_weights.restore_untaken(model)
    last = max(i for i, g in enumerate(groups) if g)
    for i, layer in enumerate(layers):
        if groups[i]:
            pre, post = _layer_hooks(streamer, i, last)
            streamer.handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    for stored in streamer.by_slot():
        slot = stored[0].slot
        streamer.handles.append(slot.param.register_post_accumulate_grad_hook(_after_grad(streamer, slot, stored)))
    streamer.handles.append(model._register_state_dict_hook(_state_dict_hook(streamer, model)))
    streamer.restore = _wrap_deferred_writes(streamer, opt)
    return streamer


def _state_dict_hook(streamer: WeightStreamer, model: nn.Module) -> Callable:
    names = {id(p): n for n, p in model.named_parameters()}
    owned = [(names[id(w.param)], w.param) for w in streamer.weights()]
    quantized = [stored[0].slot for stored in streamer.by_slot() if is_quantized(stored[0].slot.param)]

    def hook(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        if module is model:  # the model's own state_dict (not a submodule's)
            for name, p in owned:
                if prefix + name in state:
                    state[prefix + name] = readable(p)
            for s in quantized:  # an INT8 weight's export, from its codes and scales as stored now
                state[prefix + s.name] = s.param.exported(*(readable(t) for t in s.param.stored_tensors())).detach()

    return hook


def host_tensors(model: nn.Module) -> list[Tensor]:
    """The host copies of ``model``'s streamed weights (the memory meter's host ``params``)."""
    return [entry[1].host for p in model.parameters() if (entry := _STREAMED.get(p)) is not None]


def readable(p: Tensor) -> Tensor:
    """``p``'s current values for a reader outside the step (a checkpoint, an export): the host copy of a released
    streamed weight (its write-back waited for), else ``p`` itself, detached."""
    entry = _STREAMED.get(p)
    if entry is None or entry[1].on_device:
        return p.detach()
    w = entry[1]
    if w.stored is not None:
        w.stored.synchronize()
        w.stored = None
    return w.host


def writable(p: Tensor) -> Tensor:
    """Where a loader writes ``p``'s values (a checkpoint's resume): the host copy of a streamed weight (a device
    copy, if any, dropped: the next fetch brings the loaded values), else ``p`` itself, detached."""
    entry = _STREAMED.get(p)
    if entry is None:
        return p.detach()
    streamer, w = entry
    streamer.release(w, write_back=False)
    readable(p)  # a write-back in flight must not land after the load
    return w.host
