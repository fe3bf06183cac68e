"""Apply an ``ActivationPolicy`` to a model so that what autograd keeps really is the chosen form.

Mechanism (no model code is edited; ``ActivationHandle.remove()`` restores everything):
* each component's modules get their ``forward`` wrapped (an instance attribute) so that it runs inside
  ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``: the innermost scope wins, so a tensor saved by an
  op is packed by the action of the innermost component module running that op (keep -> the tensor itself,
  codec -> ``codecs.encode`` output, offload_cpu -> a host copy); unpack decodes it in backward;
* ``recompute`` wraps the scope in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; scope hooks
  are off inside recompute regions (the checkpoint's own hooks must stay innermost);
* Llama attention: ``attn_core`` is the attention function (eager / sdpa / ...), interposed through a
  per-module config copy naming the ``hmt_core`` entry of transformers' AttentionInterface (Megatron
  selective recompute, Korthikanti et al. 2022, Sec. 4.2: checkpoint QK^T, softmax, dropout, attention over V);
  ``attn_qkv=recompute`` checkpoints the attention block from its input up to (not including) o_proj, which
  runs outside the region so that its input (``attn_out``) can be compressed instead of recomputed;
* ``layer_recompute`` checkpoints every decoder layer (full activation checkpointing: only layer inputs kept).
Supported models: Llama-family ``*ForCausalLM`` (``model.layers[i].{self_attn,mlp,input_layernorm,
post_attention_layernorm}``, ``model.norm``, ``lm_head``; eager and sdpa attention) and any module tree whose
component modules are named in ``policy.modules`` (generic nn.Linear stacks; no attn_core there).
"""

from __future__ import annotations

import copy
import fnmatch
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from hmt_core.activations.codecs import decode, encode
from hmt_core.activations.measure import ErrorAccumulator, SavedBytesCounter, saved_metrics
from hmt_core.activations.policy import CODEC_ACTIONS, COMPONENTS, ActivationPolicy
from hmt_core.activations.saved import Offloaded, input_pack, unpack

OTHER = "other"  # saved outside every component scope (logits, loss)
_CORE_IMPL = "hmt_core"


def _tensors(tree: Any) -> Iterator[Tensor]:
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


class _State:
    def __init__(self, model: nn.Module, policy: ActivationPolicy, errors: ErrorAccumulator | None) -> None:
        self.model, self.policy, self.errors = model, policy, errors
        self.region_depth = 0  # > 0 inside a checkpoint region (forward or recompute): scope hooks off
        self.bypass: set[int] = set()  # ids of o_proj modules that pass their input through (attn_qkv region)
        self.counter = SavedBytesCounter()
        # (storage, offset, shape, stride, dtype, version) -> (storage ref, packed): one encode per tensor even
        # when ops save different view objects of it (q/k/v_proj and gate/up_proj save reshaped views)
        self.cache: dict[tuple, tuple[StorageWeakRef, Any]] = {}
        self.params: set[StorageWeakRef] = set()

    def start_forward(self) -> None:
        self.counter.reset()
        self.cache.clear()
        self.params = {StorageWeakRef(p.untyped_storage()) for p in self.model.parameters()}

    def is_param(self, t: Tensor) -> bool:
        """A parameter or a view of one (``F.linear`` saves ``weight.t()``). Under FSDP2 ``model.parameters()``
        are the sharded DTensors, whose storage is not that of the all-gathered parameter a layer runs with: the
        view's ``_base`` (that unsharded ``nn.Parameter``) identifies it instead."""
        return (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
                or StorageWeakRef(t.untyped_storage()) in self.params)

    def count_retained(self, component: str, args: Any, kwargs: Any) -> None:
        self.counter.add(component, [t for t in _tensors((args, kwargs)) if not self.is_param(t)])

    def pack_fn(self, component: str, action: str) -> Callable[[Tensor], Any]:
        p = self.policy
        lossy = action in CODEC_ACTIONS or action == "offload_cpu"

        def pack(t: Tensor) -> Any:
            if self.is_param(t):
                return t
            if not lossy or not t.is_floating_point() or t.numel() == 0:
                self.counter.add(component, [t])
                return t.detach()  # not t: a packed tensor holding its own grad_fn is a cycle no collector frees
            ref = StorageWeakRef(t.untyped_storage())
            key = (ref, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
            hit = self.cache.get(key)
            if hit is not None and not hit[0].expired():
                return hit[1]
            if action == "offload_cpu":
                packed = t.detach() if t.device.type == "cpu" else Offloaded(t)
                if not isinstance(packed, Offloaded):
                    self.counter.add(component, [t])
            else:
                packed = encode(t, action, block=p.block_size, fp8_format=p.fp8_format, z_threshold=p.outlier_z,
                                max_outlier_frac=p.max_outlier_frac)
                self.counter.add(component, packed.tensors)
                if self.errors is not None:
                    self.errors.add(component, t, decode(packed))
            self.cache[key] = (ref, packed)
            return packed

        return pack

    def region(self, fn: Callable, bypass: nn.Module | None = None) -> Callable:
        """``fn`` run with scope hooks off (and ``bypass``'s forward an identity): body of a checkpoint region."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self.region_depth += 1
            if bypass is not None:
                self.bypass.add(id(bypass))
            try:
                return fn(*args, **kwargs)
            finally:
                self.region_depth -= 1
                if bypass is not None:
                    self.bypass.discard(id(bypass))

        return run

    def active(self) -> bool:
        return self.region_depth == 0 and torch.is_grad_enabled()


def _scoped(state: _State, module: nn.Module, component: str, action: str, orig: Callable) -> Callable:
    pack = state.pack_fn(component, action)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if id(module) in state.bypass:
            return args[0] if args else next(iter(kwargs.values()))
        if not state.active():
            return orig(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return orig(*args, **kwargs)

    return forward


def _recomputed(state: _State, component: str, orig: Callable, *, after: nn.Module | None = None,
                codec: str | None = None) -> Callable:
    """Checkpoint ``orig``; with ``after`` (o_proj) the region stops before it and ``after`` runs outside. With
    ``codec`` the checkpoint's saved first input (the layer input) is stored encoded by that codec action."""
    body = state.region(orig, bypass=after)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not state.active():
            return orig(*args, **kwargs)
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            # a KV cache is written during the forward; the recompute would write it a second time (as HF does)
            kwargs = {**kwargs, "past_key_values": None, "use_cache": False} if "use_cache" in kwargs else \
                {**kwargs, "past_key_values": None}
        if codec is None or not args or not isinstance(args[0], Tensor):
            state.count_retained(component, args, kwargs)
            out = checkpoint(body, *args, use_reentrant=False, **kwargs)
        else:
            state.count_retained(component, args[1:], kwargs)
            with torch.autograd.graph.saved_tensors_hooks(input_pack(state.pack_fn(component, codec), args[0]), unpack):
                out = checkpoint(body, *args, use_reentrant=False, **kwargs)
        if after is None:
            return out
        return (after(out[0]), *out[1:]) if isinstance(out, tuple) else after(out)

    return forward


def _register_core_interface() -> None:
    from transformers.modeling_utils import AttentionInterface

    def hmt_core(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return module._hmt_attention_core(module, *args, **kwargs)

    AttentionInterface.register(_CORE_IMPL, hmt_core)


def _core_fn(state: _State, attn: nn.Module, action: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    default = getattr(sys.modules[type(attn).__module__], "eager_attention_forward", None)
    impl = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, default)
    if impl is None:
        raise ValueError(f"activation.attn_core: no attention function for {attn.config._attn_implementation!r}")
    if action == "recompute":
        return _recomputed(state, "attn_core", impl)
    pack = state.pack_fn("attn_core", action)

    def core(*args: Any, **kwargs: Any) -> Any:
        if not state.active():
            return impl(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return impl(*args, **kwargs)

    return core


def _is_llama_lm(module: nn.Module) -> bool:
    layers = getattr(getattr(module, "model", None), "layers", None)
    needed = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    return (isinstance(layers, nn.ModuleList) and len(layers) > 0 and hasattr(module, "lm_head")
            and all(hasattr(layer, n) for layer in layers for n in needed)
            and all(hasattr(layer.self_attn, "o_proj") for layer in layers))


def llama_scopes(model: nn.Module) -> dict[str, list[str]] | None:
    """Default component -> module names for a Llama-family ``*ForCausalLM`` (the model itself or the first such
    submodule, e.g. inside a PEFT wrapper); None if there is none."""
    root = next((name for name, m in model.named_modules() if _is_llama_lm(m)), None)
    if root is None:
        return None
    lm = model.get_submodule(root)
    head = f"{root}." if root else ""
    base, prefix = lm.model, f"{head}model"
    names = [f"{prefix}.layers.{i}" for i in range(len(base.layers))]
    return {
        "embedding": [f"{names[0]}.input_layernorm"],
        "attn_qkv": [f"{n}.self_attn" for n in names],
        "attn_core": [f"{n}.self_attn" for n in names],  # the attention function called by these modules
        "attn_out": [f"{n}.self_attn.o_proj" for n in names],
        "mlp_intermediate": [f"{n}.mlp" for n in names],
        "residual": names,
        "norm": [f"{n}.input_layernorm" for n in names[1:]] + [f"{n}.post_attention_layernorm" for n in names]
        + ([f"{prefix}.norm"] if hasattr(base, "norm") else []),
        "lm_head": [f"{head}lm_head"],
    }


def resolve_scopes(model: nn.Module, policy: ActivationPolicy) -> tuple[dict[str, list[str]], bool]:
    """Component -> module names (validated against the model), and whether the Llama layout is used."""
    names = dict(model.named_modules())
    llama = llama_scopes(model)
    scopes: dict[str, list[str]] = {c: list(v) for c, v in (llama or {}).items()}
    if "attn_core" in policy.modules:
        raise ValueError("activation.modules.attn_core: the attention core is the attention function of Llama-family "
                         "attention modules and cannot be named")
    for component, patterns in policy.modules.items():
        matched: list[str] = []
        for pattern in patterns:
            hits = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ValueError(f"activation.modules.{component}: no module {pattern!r} in {type(model).__name__}")
            matched += [h for h in hits if h not in matched]
        scopes[component] = matched
    if llama is None:
        needed = [c for c, a in policy.actions().items() if a != "keep"] + (["residual"] if policy.layer_recompute
                                                                          else [])
        for c in needed:
            if c == "attn_core":
                raise ValueError("activation.attn_core: only supported on Llama-family attention modules")
            if not scopes.get(c):
                raise ValueError(f"activation.{c}: {type(model).__name__} is not Llama-shaped; name its modules in "
                                 f"activation.modules.{c}")
    return scopes, llama is not None


class ActivationHandle:
    """What ``apply_policy`` installed; ``remove()`` undoes it. ``saved_bytes()`` is the last forward's count."""

    def __init__(self, state: _State, undo: list[Callable[[], None]]) -> None:
        self.policy = state.policy
        self._state, self._undo = state, undo

    def saved_bytes(self) -> dict[str, int]:
        return dict(self._state.counter.bytes)

    def metrics(self) -> dict[str, float]:
        return saved_metrics(self.saved_bytes())

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def _set_forward(module: nn.Module, fn: Callable, undo: list[Callable[[], None]]) -> None:
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.forward = fn

    def restore() -> None:
        if had:
            module.forward = old
        else:
            del module.forward

    undo.append(restore)


def apply_policy(
    model: nn.Module, policy: ActivationPolicy, *, errors: ErrorAccumulator | None = None
) -> ActivationHandle:
    """Install ``policy`` on ``model`` (call after the method's ``prepare`` and after moving to device).

    ``errors``: when given, every compressed tensor's reconstruction error is accumulated there (probe steps).
    """
    _check_unwrapped(model)
    scopes, llama = resolve_scopes(model, policy)
    state, undo = _State(model, policy, errors), []
    _wrap_components(model, policy, scopes, llama, state, undo)
    if llama:
        _interpose_cores(model, scopes.get("attn_core", []), policy.actions()["attn_core"], state, undo)
        _register_core_interface()
    _wrap_root(model, state, undo)
    model._hmt_activation_policy = True
    undo.insert(0, lambda: delattr(model, "_hmt_activation_policy"))
    return ActivationHandle(state, undo)


def _check_unwrapped(model: nn.Module) -> None:
    """Refuse a model with transformers' own gradient checkpointing or a policy already applied."""
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    if getattr(model, flag, False):
        raise ValueError("activation: the model already has transformers gradient checkpointing enabled; use "
                         "activation.layer_recompute instead")
    if getattr(model, "_hmt_activation_policy", False):
        raise ValueError("activation: a policy is already applied to this model; remove() it first")


def _wrap_components(model: nn.Module, policy: ActivationPolicy, scopes: dict[str, list[str]], llama: bool,
                     state: _State, undo: list[Callable[[], None]]) -> None:
    """Each component module's forward under its action: a saved-tensor scope or a recompute region."""
    modules = dict(model.named_modules())
    actions = policy.actions()
    # Order matters only for overlapping names: later wraps see earlier ones as ``orig``; scopes never repeat.
    wrapped: set[str] = set()
    for component in ("residual", "attn_qkv", "attn_out", "mlp_intermediate", "norm", "embedding", "lm_head"):
        for name in scopes.get(component, []):
            if name in wrapped:
                raise ValueError(f"activation.modules.{component}: module {name!r} is already in another component")
            module, action = modules[name], actions[component]
            orig = module.forward
            if action == "recompute":
                after = getattr(module, "o_proj", None) if (llama and component == "attn_qkv") else None
                fn = _recomputed(state, component, orig, after=after)
            elif component == "residual" and policy.layer_recompute:
                fn = _recomputed(state, component, orig, codec=action if action in CODEC_ACTIONS else None)
            else:
                fn = _scoped(state, module, component, action, orig)
            _set_forward(module, fn, undo)
            wrapped.add(name)


def _interpose_cores(model: nn.Module, names: list[str], action: str, state: _State,
                     undo: list[Callable[[], None]]) -> None:
    """Llama attention modules ``names`` call the ``hmt_core`` attention function (a per-module config copy)."""
    modules = dict(model.named_modules())
    for name in names:
        attn = modules[name]
        attn._hmt_attention_core = _core_fn(state, attn, action)
        original_config = attn.config
        attn.config = copy.copy(original_config)
        attn.config._attn_implementation_internal = _CORE_IMPL

        def restore(attn: nn.Module = attn, original: object = original_config) -> None:
            attn.config = original
            del attn._hmt_attention_core

        undo.append(restore)


def _wrap_root(model: nn.Module, state: _State, undo: list[Callable[[], None]]) -> None:
    """The model's forward: a new forward's counts, and what no component saves packed as ``OTHER``."""
    root_orig = model.forward
    root_pack = state.pack_fn(OTHER, "keep")

    def root_forward(*args: Any, **kwargs: Any) -> Any:
        if state.region_depth == 0 and torch.is_grad_enabled():  # a no-grad (eval) forward saves nothing: keep
            state.start_forward()  # the last training forward's counts for saved_bytes()
        if not state.active():
            return root_orig(*args, **kwargs)
        try:
            with torch.autograd.graph.saved_tensors_hooks(root_pack, unpack):
                return root_orig(*args, **kwargs)
        finally:
            state.cache.clear()  # dedup is per forward; holding packed tensors past it would delay their release

    _set_forward(model, root_forward, undo)


__all__ = ["COMPONENTS", "OTHER", "ActivationHandle", "apply_policy", "llama_scopes", "resolve_scopes"]
