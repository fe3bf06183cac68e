"""Gradient communication for multi-process training: the per-layer HMT reducer (full or low-rank) and a byte
counter wrapped around the collectives.

Low-rank gradient communication (``dist.lowrank_comm=true``, per-layer HMT Mode A under ``dist=ddp``): GaLore's
projection ``R_t = P_tᵀ G_t`` (Zhao et al. 2024, Eq. 2) is linear, so with a basis P that is identical on every
rank, ``mean_k Pᵀ G_k = Pᵀ mean_k G_k``: each rank projects its *local* gradient and only the r × n projection is
all-reduced instead of the m × n gradient (the idea of PowerSGD, Vogels et al. 2019, with GaLore's basis in place
of a power-iteration one). Refreshes still all-reduce the full gradient (the basis is computed from it); see
``hmt_core.optim.hooks``.

Bytes communicated are counted by wrapping ``torch.distributed``'s collective functions (the ones the harness,
HMT's reducer and DDP's default comm hook call) and by a DDP comm hook that counts each bucket, then runs PyTorch's
default ``allreduce_hook`` uncounted (so a bucket is counted once). A count is the *payload*: the bytes of the
tensor handed to the collective (all-reduce, broadcast: the tensor; all-gather: the gathered output; reduce-scatter:
the input), not the bytes on the wire (a ring all-reduce sends ≈ 2(W−1)/W of the payload per rank). Each count goes
to the current scope: ``grad`` (the default: gradient traffic), ``control`` (the loop's loss mean, finite flag and
memory gather), ``setup`` (the initial parameter broadcast), ``param`` (FSDP2's all-gathers of the weights in
training steps), ``eval`` (evaluation's forwards), ``checkpoint`` (gathering state for a save).

Under FSDP2 two more kinds of call are counted: FSDP2's own ``dist.all_gather_single`` (the weights, forward and
backward: scope ``param``) and ``dist.reduce_scatter_single`` (the gradients: ``grad``), and the functional
collectives DTensor issues when it redistributes (``torch.distributed._functional_collectives``' ``all_reduce``,
``all_gather_single``, ``reduce_scatter_single``: galore-torch's and apollo-torch's optimizers on shards, hmt's
gathered refresh gradient, clipping norms), counted in the current scope.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

MIB = 2**20
COUNTED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "reduce_scatter", "all_to_all_single", "all_gather_single", "reduce_scatter_single")
FUNCTIONAL = ("all_reduce", "all_gather_single", "reduce_scatter_single")  # what DTensor's redistribution calls
SCOPE_OF = {"all_gather_single": "param"}  # FSDP2's weight all-gathers (the only caller of dist.all_gather_single)


def _nbytes(t) -> int:
    if isinstance(t, Tensor) and t.is_sparse:  # what is sent: the indices and the values, not the dense shape
        return _nbytes(t._indices()) + _nbytes(t._values())
    if isinstance(t, Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def payload_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """The payload of one collective call (see the module docstring): its first tensor argument (output lists
    for ``all_gather``, the output tensor for ``all_gather_into_tensor``, the input for reduce-scatter)."""
    if name == "reduce_scatter_tensor":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
    if name == "reduce_scatter":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_list"))
    if name == "reduce_scatter_single":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
    return _nbytes(args[0] if args else next(iter(kwargs.values()), None))


def _group_size(group) -> int:
    """Ranks in a functional collective's ``group``: a (DeviceMesh, dim) pair, a mesh, a process group, a rank list."""
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "size"):
        return group[0].size(group[1])
    if hasattr(group, "size") and callable(group.size):
        return group.size()
    if isinstance(group, (list, tuple)):
        return len(group)
    return dist.get_world_size()


def functional_payload_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """The payload of a functional collective (``self`` is the input): the input for all-reduce and
    reduce-scatter, the gathered output (input × group size) for all-gather."""
    tensor = args[0] if args else kwargs.get("self")
    if name == "all_gather_single":
        group = args[2] if len(args) > 2 else kwargs.get("group")
        return _nbytes(tensor) * _group_size(group)
    return _nbytes(tensor)


class CommCounter:
    """Bytes handed to collectives, by scope; ``install`` wraps ``torch.distributed``'s functions until
    ``uninstall``. One per process."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {"grad": 0, "param": 0, "control": 0, "setup": 0}
        self.calls: dict[str, int] = {k: 0 for k in self.bytes}
        self._scope: str | None = "grad"
        self._originals: dict[tuple[object, str], object] = {}

    # ---- scopes
    @contextlib.contextmanager
    def scope(self, name: str | None):
        """Count what runs inside under ``name`` (None: not at all)."""
        before, self._scope = self._scope, name
        try:
            yield
        finally:
            self._scope = before

    def add(self, nbytes: int) -> None:
        if self._scope is not None:
            self.bytes[self._scope] = self.bytes.get(self._scope, 0) + int(nbytes)
            self.calls[self._scope] = self.calls.get(self._scope, 0) + 1

    # ---- wrapping torch.distributed
    def install(self) -> CommCounter:
        import torch.distributed._functional_collectives as funcol

        for module, names, payload in ((dist, COUNTED, payload_bytes), (funcol, FUNCTIONAL, functional_payload_bytes)):
            for name in names:
                original = getattr(module, name, None)
                if original is None or (module, name) in self._originals:
                    continue
                self._originals[(module, name)] = original
                scope = SCOPE_OF.get(name) if module is dist else None
                setattr(module, name, self._wrap(name, original, payload, scope))
        return self

    def uninstall(self) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals = {}

    def _wrap(self, name: str, original, payload, scope: str | None):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if scope is not None and self._scope == "grad":  # training's default scope; eval etc. keep theirs
                with self.scope(scope):
                    self.add(payload(name, args, kwargs))
            else:
                self.add(payload(name, args, kwargs))
            return original(*args, **kwargs)

        return counted

    # ---- DDP
    def ddp_hook(self, state, bucket):  # bucket: dist.GradBucket -> Future[Tensor] (DDP checks real annotations)
        """DDP comm hook: count the bucket, then PyTorch's default (divide by W, all-reduce SUM) uncounted."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.add(_nbytes(bucket.buffer()))
        with self.scope(None):
            return allreduce_hook(state, bucket)

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


class GradAverager:
    """Per-layer HMT's ``reduce_grad`` (``hmt_core.parallel.GradReducer``): the mean over ranks of the gradients
    handed to it (full gradients, or with ``lowrank`` a Mode A weight's projection), bucketed and asynchronous like
    torch DDP's ``Reducer``.

    Tensors are packed in hook order into fp32 buckets of about ``bucket_bytes``; a full bucket is all-reduced
    (SUM) with ``async_op=True``, then the previous bucket is waited, divided by W (after the fp32 sum, not before),
    copied back into its tensors (in place, cast to their dtype) and each tensor's ``done`` callback runs, in the
    order the tensors came. ``flush`` launches the last, partly filled bucket and completes every bucket (the engine
    calls it at the end of each backward). So the reduction of bucket k overlaps the hook work of bucket k−1, and
    the continuations run in hook order (the per-layer updates, their stochastic-rounding draws and the non-finite
    decisions keep the unbucketed order). ``bucket_bytes=0``: every tensor is its own bucket.

    ``row_sparse`` (with ``lowrank``): names of parameters whose gradient is row-sparse — an ``nn.Embedding``'s
    weight (not tied to an output layer) has non-zero rows only for the tokens in the batch. Those gradients are
    all-reduced at once (after launching the bucket filled so far) as a sparse COO tensor of their non-zero rows
    (``torch.distributed``'s sparse all-reduce, which gloo implements; NCCL does not, so on NCCL they stay dense).
    Exact: rows that are zero on every rank stay zero, the others are summed like the dense all-reduce sums them."""

    def __init__(self, world_size: int, *, lowrank: bool = False, row_sparse: frozenset[str] = frozenset(),
                 bucket_bytes: int = 25 * MIB, group=None) -> None:
        self.world_size, self.lowrank, self.row_sparse = world_size, lowrank, frozenset(row_sparse)
        self.bucket_bytes, self.group = int(bucket_bytes), group
        self._filling: list[tuple[Tensor, Callable[[], None]]] = []
        self._filling_bytes = 0
        self._in_flight: collections.deque[_Bucket] = collections.deque()

    def full(self, grad: Tensor, name: str, done: Callable[[], None]) -> None:  # grad: any parameter's shape
        if self.lowrank and name in self.row_sparse and grad.dim() == 2:
            self._launch()
            all_reduce_rows(grad, self.group)
            grad.div_(self.world_size)
            self._in_flight.append(_Bucket(None, None, [(grad, done)]))
            return self._complete(keep=1)
        self._add(grad, done)

    def projected(self, low: Tensor, done: Callable[[], None]) -> None:  # low: Ĝ = project(G_local), fp32
        self._add(low, done)

    def rows(self, ids: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:  # ids: (N,); values: (N, d)
        """Every rank's (ids, gradient rows) of a row-sparse embedding (``hmt_core.sparse_embedding``), concatenated
        in rank order ((W·N,), (W·N, d)): the rows travel as rows. Buckets handed over before are completed first
        (hook order). Every rank holds the same N tokens (the global batch split by rows)."""
        self.flush()
        out_ids = ids.new_empty((self.world_size * ids.numel(),))
        out_values = values.new_empty((self.world_size * values.shape[0], values.shape[1]))
        dist.all_gather_into_tensor(out_ids, ids.contiguous(), group=self.group)
        dist.all_gather_into_tensor(out_values, values.contiguous(), group=self.group)
        return out_ids, out_values

    def flush(self) -> None:
        """Launch the partly filled bucket, then wait every bucket and run its callbacks, in order."""
        self._launch()
        self._complete(keep=0)

    def _add(self, t: Tensor, done: Callable[[], None]) -> None:
        self._filling.append((t, done))
        self._filling_bytes += t.numel() * 4  # the fp32 bucket's bytes
        if self._filling_bytes >= self.bucket_bytes:
            self._launch()
            self._complete(keep=1)  # the bucket just launched stays in flight while the previous one is used

    def _launch(self) -> None:
        if not self._filling:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t, _ in self._filling])  # (Σ numel,) fp32
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._in_flight.append(_Bucket(work, flat, self._filling))
        self._filling, self._filling_bytes = [], 0

    def _complete(self, *, keep: int) -> None:
        while len(self._in_flight) > keep:
            bucket = self._in_flight.popleft()
            if bucket.flat is not None:
                bucket.work.wait()
                bucket.flat.div_(self.world_size)  # the mean, from the fp32 sum
                offset = 0
                for t, _ in bucket.entries:
                    t.copy_(bucket.flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
            for _, done in bucket.entries:
                done()


@dataclass
class _Bucket:
    work: object | None  # dist.Work of the async all-reduce; None: reduced already (a sparse gradient)
    flat: Tensor | None  # (Σ numel,) fp32, the entries packed in order
    entries: list[tuple[Tensor, Callable[[], None]]]


def all_reduce_rows(grad: Tensor, group=None) -> None:  # grad: (rows, cols), most rows zero
    """All-reduce SUM of ``grad`` in place, sending only its non-zero rows (sparse COO all-reduce)."""
    rows = grad.abs().amax(dim=1).nonzero().flatten()  # (nnz_rows,)
    sparse = torch.sparse_coo_tensor(rows.unsqueeze(0), grad.index_select(0, rows), grad.shape,
                                     check_invariants=False, is_coalesced=True)
    dist.all_reduce(sparse, op=dist.ReduceOp.SUM, group=group)
    sparse = sparse.coalesce()
    grad.zero_().index_copy_(0, sparse.indices()[0], sparse.values())


def row_sparse_names(model) -> frozenset[str]:
    """Parameter names of the model's ``nn.Embedding`` weights that no other module shares (a tied LM head makes the
    gradient dense), as ``GradAverager.row_sparse`` expects them."""
    from torch import nn

    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    shared = {id(m.weight) for m in model.modules() if not isinstance(m, nn.Embedding) and
              isinstance(getattr(m, "weight", None), Tensor)}
    return frozenset(n for n, p in model.named_parameters() if id(p) in embedding - shared)


class StepBytes:
    """Gradient bytes per step from a counter: the loop calls ``DistContext.mean`` once per step (``step``)."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter, self.steps = counter, 0
        self._mark_bytes, self._mark_param, self._mark_steps = 0, 0, 0

    def step(self) -> None:
        self.steps += 1

    def metrics(self) -> dict[str, float]:
        """Gradient bytes per step since the previous call (a logged step), in MiB and bytes."""
        grad, param, steps = self.counter.bytes["grad"], self.counter.bytes["param"], self.steps
        n = max(1, steps - self._mark_steps)
        per, per_param = (grad - self._mark_bytes) / n, (param - self._mark_param) / n
        self._mark_bytes, self._mark_param, self._mark_steps = grad, param, steps
        out = {"comm/grad_bytes_per_step": per, "comm/grad(MiB)": per / MIB}
        if param:  # FSDP2: the weights' all-gathers
            out.update({"comm/param_bytes_per_step": per_param, "comm/param(MiB)": per_param / MIB})
        return out

    def summary(self) -> dict:
        c = self.counter
        return {"grad_bytes_total": c.bytes["grad"], "grad_bytes_per_step": c.bytes["grad"] // max(1, self.steps),
                "param_bytes_total": c.bytes["param"], "param_bytes_per_step": c.bytes["param"] // max(1, self.steps),
                "control_bytes_total": c.bytes["control"], "setup_bytes_total": c.bytes["setup"],
                "steps": self.steps, "counted": "payload bytes handed to collectives (not wire bytes)"}
