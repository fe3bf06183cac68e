"""FSDP2's start on the meta device, in torchtitan's order: build the model on ``meta`` (no memory), ``fully_shard``
it, ``to_empty`` onto the device (this rank's shards, uninitialised), then fill each shard with exactly the values
the single-process build gives: the same seeded RNG stream, consumed in the same order.

The single-process build (``experiments.models.build_model`` on a real device) draws from the RNG in two kinds of
places, interleaved: module constructors (``nn.Linear``'s ``kaiming_uniform_``, ``nn.Embedding``'s ``normal_``,
transformers' ``Conv1D``'s ``normal_``, ...) and each ``PreTrainedModel``'s ``post_init`` → ``init_weights`` →
``initialize_weights`` (``_init_weights`` on every module of its subtree not yet initialised, in ``smart_apply``'s
post-order), which overwrites the constructors' values. ``record_build`` builds on meta under a dispatch mode that
records, in order, every seeded random op (``torch.Tag.nondeterministic_seeded``) and every ``init_weights`` call
(on meta, transformers skips the init itself and only ties weights). ``replay`` then, after ``to_empty``:
- a constructor's random op: run on a throwaway tensor of the same shape, dtype and device (the RNG advances
  exactly as in the single-process build; the values die, as there);
- an ``init_weights`` call: ``_initialize_weights`` (under transformers' guarded init functions, no grad) on one
  module at a time, in ``smart_apply``'s order; each in-place op it runs on a sharded parameter (``normal_``,
  ``ones_``, ...) runs instead on a full-size tensor on the device, so it draws from the RNG as the
  single-process parameter does; this rank's rows of it (a view at DCP's offsets) are copied into the local
  shard, and it is freed. An op whose result depends on the old values (not in ``_OVERWRITES``) first gathers
  them (``full_tensor``). Buffers (rotary ``inv_freq``) are plain tensors, initialised in place by
  ``_init_weights``, as when transformers loads on meta. A tie target's writes are dropped: the tie source's
  values stand, as after ``tie_weights``.

Start-up peak per rank: this rank's shards + buffers + the largest parameter at full size. Every shard and
floating buffer is NaN-filled after ``to_empty``; a NaN left after the replay means no init reached it
(``UnreplayableInit``). Measurements and limits: ``docs/fsdp2_meta_init.md``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from hmt_core.module_tensors import replace_owned_tensors


class UnreplayableInit(ValueError):
    """The single-process init cannot be reproduced shard by shard (an op or a value the replay does not cover)."""


@dataclass(frozen=True, kw_only=True)
class RandomOp:
    """One seeded random op of a constructor: ``func(target, *args, **kwargs)`` (in place) or a factory."""

    func: torch._ops.OpOverload
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple
    kwargs: dict
    inplace: bool


@dataclass(frozen=True, kw_only=True)
class InitWeights:
    """A ``PreTrainedModel.init_weights`` call (its ``post_init``) at this point of the build."""

    model: nn.Module


@dataclass(kw_only=True)
class BuildRecord:
    """What the single-process build draws from the RNG, in order, and the RNG state it starts from."""

    events: list[RandomOp | InitWeights] = field(default_factory=list)
    rng_state: torch.Tensor | None = None
    cuda_rng_state: list[torch.Tensor] | None = None


class _Recorder(TorchDispatchMode):
    def __init__(self, record: BuildRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.record.events.append(_random_op(func, args, kwargs))
        return func(*args, **kwargs)


def _random_op(func, args: tuple, kwargs: dict) -> RandomOp:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    target = args[0] if args and isinstance(args[0], torch.Tensor) else None
    inplace = target is not None and func._schema.is_mutable
    if tensors and not (inplace and len(tensors) == 1 and target.is_contiguous()):
        raise UnreplayableInit(f"the model's constructor runs {func} on tensor inputs (only a random op in place "
                               "on one contiguous tensor, or a random factory, is replayed)")
    if inplace:
        return RandomOp(func=func, shape=tuple(target.shape), dtype=target.dtype, args=tuple(args[1:]),
                        kwargs=dict(kwargs), inplace=True)
    return RandomOp(func=func, shape=(), dtype=kwargs.get("dtype") or torch.get_default_dtype(), args=tuple(args),
                    kwargs=dict(kwargs), inplace=False)


@contextlib.contextmanager
def _init_weights_logged(record: BuildRecord):
    """``PreTrainedModel.init_weights`` logs itself into ``record`` while the model is built (then runs: on meta it
    only ties weights)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.init_weights

    def logged(self, *args, **kwargs):
        record.events.append(InitWeights(model=self))
        return original(self, *args, **kwargs)

    PreTrainedModel.init_weights = logged
    try:
        yield
    finally:
        PreTrainedModel.init_weights = original


def record_build(make: Callable[[], nn.Module]) -> tuple[nn.Module, BuildRecord]:
    """``make()`` (a build on the meta device) with its RNG draws recorded; the RNG state is the one it starts
    from (restored by ``replay``)."""
    record = BuildRecord(rng_state=torch.get_rng_state(),
                         cuda_rng_state=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    with _init_weights_logged(record), _Recorder(record):
        model = make()
    bad = next((n for n, p in model.named_parameters() if p.device.type != "meta"), None)
    if bad is not None:
        raise UnreplayableInit(f"{bad} was built on {next(model.parameters()).device}, not on meta")
    return model, record


@torch.no_grad()
def replay(model: nn.Module, record: BuildRecord, device: torch.device) -> None:
    """Fill the sharded ``model`` (``fully_shard`` + ``to_empty(device)`` done) with the single-process values."""
    torch.set_rng_state(record.rng_state)
    if record.cuda_rng_state is not None:
        torch.cuda.set_rng_state_all(record.cuda_rng_state)
    _fill_nan(model)
    tied = _Tied(model)
    for event in record.events:
        if isinstance(event, RandomOp):
            _draw(event, device)
        else:
            _initialize(event.model, tied)
    _check_filled(model)


class _Tied:
    """Which (module, parameter name) is a tie target (``all_tied_weights_keys``: target -> source)."""

    def __init__(self, model: nn.Module) -> None:
        self.targets = set(getattr(model, "all_tied_weights_keys", None) or {})
        self.prefix = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def is_target(self, module: nn.Module, name: str) -> bool:
        prefix = self.prefix.get(id(module), "")
        return (f"{prefix}.{name}" if prefix else name) in self.targets


def _draw(op: RandomOp, device: torch.device) -> None:
    """The RNG draw of one constructor op, on a throwaway tensor (its values are overwritten in the build)."""
    if op.inplace:
        op.func(torch.empty(op.shape, dtype=op.dtype, device=device), *op.args, **op.kwargs)
    else:
        op.func(*op.args, **{**op.kwargs, "device": device})


def _initialize(root: nn.Module, tied: _Tied) -> None:
    """``root.initialize_weights()``: transformers' ``smart_apply`` (children first, a nested ``PreTrainedModel``
    with its own ``_initialize_weights``; a module already initialised skipped), each write to a sharded parameter
    done at full size (``_FullWrites``)."""
    from transformers import PreTrainedModel
    from transformers import initialization as hf_init

    def visit(module: nn.Module, fn) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        if not getattr(module, "_is_hf_initialized", False):
            discard = {id(p) for k, p in module._parameters.items() if p is not None and tied.is_target(module, k)}
            with _FullWrites(discard):
                fn(module, custom)
            module._is_hf_initialized = True

    custom = root.is_custom_code()
    with hf_init.guard_torch_init_functions():
        visit(root, root._initialize_weights)


# in-place ops (Tensor methods, and torch.nn.init's functions, which dispatch as themselves) whose result does not
# depend on the tensor's previous values; any other in-place op on a sharded parameter gathers them first
_OVERWRITES = frozenset({
    "normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "exponential_", "cauchy_", "log_normal_",
    "geometric_", "bernoulli_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_"})


class _FullWrites(torch.overrides.TorchFunctionMode):
    """An in-place op on a sharded parameter (``_init_weights``' ``normal_``, ``ones_``, ``zeros_``, ...) runs on a
    full-size tensor of it on the same device, so it draws from the RNG exactly as on the single-process
    parameter; this rank's rows are then copied into the shard and the full tensor freed. Writes to a tie target
    (``discard``) draw but are dropped: the tie source's values stand, as after ``tie_weights``."""

    def __init__(self, discard: set[int]) -> None:
        super().__init__()
        self.discard = discard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor")
        if not (isinstance(target, DTensor) and name.endswith("_") and not name.startswith("__")):
            return func(*args, **kwargs)
        if name in _OVERWRITES:
            full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
        else:
            full = target.full_tensor()
        if args:
            func(full, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": full})
        if id(target) not in self.discard:
            target.to_local().copy_(_local_view(full, target))
        return target


def _local_view(full: torch.Tensor, target) -> torch.Tensor:
    """This rank's block of ``full`` (the global tensor of the DTensor ``target``), as a view: no copy. The same
    offsets DCP reads shards with."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _fill_nan(model: nn.Module) -> None:
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            (t.to_local() if hasattr(t, "to_local") else t).fill_(float("nan"))


def _check_filled(model: nn.Module) -> None:
    """One host sync at start-up: a NaN left means no init reached that tensor (named in the error)."""
    named = [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in [*model.named_parameters(),
                                                                               *model.named_buffers()]]
    named = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
    if not named:
        return
    left = torch.stack([torch.isnan(t).any() for _, t in named]).cpu()
    if bool(left.any()):
        name = named[int(left.nonzero()[0])][0]
        raise UnreplayableInit(f"{name}: the model's _init_weights leaves it uninitialised, so its "
                               "single-process values cannot be reproduced shard by shard")


def materializer(root: nn.Module, device: torch.device) -> Callable[[nn.Module], None]:
    """For a model built on meta and prepared one module at a time (``Method.prepare``'s ``materialize``): make a
    module's own parameters and buffers on ``device`` and initialise them with transformers' ``_init_weights`` for
    that module (random draws on the device's generator, in the order the method asks for the modules: the values
    are a fresh draw from the same initialisation, not the single-process build's; ``replay`` gives those).
    Tensors are replaced, not swapped (``Module.to_empty`` swaps, which FakeTensorMode's tensors forbid); a tensor
    shared by two modules (tied weights) is made once."""
    from transformers import PreTrainedModel
    from transformers import initialization as hf_init

    made = WeakIdKeyDictionary()  # meta tensor -> its tensor on the device, while a module still holds the meta one

    @torch.no_grad()
    def materialize(module: nn.Module) -> None:
        owned = {**module._parameters, **module._buffers}
        if not any(t is not None and t.is_meta for t in owned.values()):
            return
        replace_owned_tensors(module, lambda t: t.is_meta, lambda t: torch.empty_like(t, device=device), made)
        if isinstance(root, PreTrainedModel):
            with hf_init.guard_torch_init_functions():
                root._init_weights(module)
        module._is_hf_initialized = True

    return materialize
