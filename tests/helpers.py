"""Shared test helpers as plain functions: the tiny Llama and token batches the equivalence tests use, a
tolerance check that reports every offending tensor in one table, and the teacher-forced (one step at a time,
from the same state) comparison of HMT with a reference optimizer."""

from __future__ import annotations

import copy
import itertools
import os
import socket
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    return LlamaForCausalLM(cfg).to(dtype)


def batches(n: int, seed: int = 1, batch: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, 16), generator=gen) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ tolerances
def _mismatch(name: str, actual: Tensor, expected: Tensor, rtol: float, atol: float,
              of_max: bool) -> tuple | None:
    """A table row if ``|actual − expected| ≤ atol + rtol·|expected|`` fails somewhere (or shapes differ, or a
    value is not finite), else None; ``of_max``: atol is a fraction of ``max|expected|``. Arithmetic in fp64 so
    the check itself does not round."""
    if actual.shape != expected.shape:
        return (name, f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}", "", "", "", "")
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return (name, "non-finite values", "", "", "", "")
    diff = (a - b).abs()
    if of_max:
        atol = atol * float(b.abs().max()) if b.numel() else 0.0
    excess = diff - (atol + rtol * b.abs())
    if not bool((excess > 0).any()):
        return None
    worst = int(torch.argmax(excess))
    norm_rel = float(diff.norm() / b.norm()) if float(b.norm()) > 0 else float("inf")
    return (name, f"{float(diff.max()):.3e}", f"{norm_rel:.3e}", f"{float(b.flatten()[worst]):+.6e}",
            f"{float(a.flatten()[worst]):+.6e}", f"{float(diff.flatten()[worst]):.3e}")


def assert_tensors_close(rows: Iterable[tuple[str, Tensor, Tensor]], *, rtol: float, atol: float, step: int,
                         what: str = "", atol_of_max: bool = False) -> None:
    """Every ``(name, actual, expected)`` satisfies ``|actual − expected| ≤ atol + rtol·|expected|`` element-wise
    (``atol_of_max``: atol is a fraction of that tensor's ``max|expected|``, the scale of rounding errors where
    terms cancel); otherwise fail with one table naming the step, every offending tensor, its max abs diff, its
    norm-wise relative diff ``‖a − b‖/‖b‖``, the worst element (b, a and |a − b| where the bound is exceeded the
    most) and the tolerance."""
    bad = [r for r in (_mismatch(n, a, b, rtol, atol, atol_of_max) for n, a, b in rows) if r is not None]
    if not bad:
        return
    head = ("tensor", "max|a-b|", "‖a-b‖/‖b‖", "worst element: b", "a", "|a-b|")
    table = [head, *bad]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in table]
    bound = f"rtol={rtol:.1e}, atol={atol:.1e}" + ("*max|b|" if atol_of_max else "")
    raise AssertionError(f"step {step}: {len(bad)} {what or 'tensor'}(s) differ beyond |a-b| <= atol + rtol*|b| "
                         f"({bound}; a = actual, b = expected):\n" + "\n".join(lines))


def assert_params_close(a_model: nn.Module, b_model: nn.Module, *, rtol: float, atol: float, step: int) -> None:
    """All parameters of ``a_model`` close to ``b_model``'s (same order), reported as one table on failure."""
    rows = [(n, p, q) for (n, p), q in zip(a_model.named_parameters(), b_model.parameters())]
    assert_tensors_close(rows, rtol=rtol, atol=atol, step=step, what="parameter")


# ----------------------------------------------------------------------------------- teacher-forced comparison
# A reference run is recorded as snapshots: snapshots[k] = the parameters and optimizer state *before* step k
# (k = 0 .. steps). HMT is then replayed one step at a time from each snapshot (teacher forcing): rounding
# differences of one step cannot compound over the run, so tolerances are those of a single update.
#
# Optimizer state of one parameter, in a common format (``reference_snapshot`` / ``hmt_snapshot``): step, m, v;
# for projected parameters basis (galore-torch / apollo-torch ``ortho_matrix``: (r, in) = Qᵀ or (out, r) = P,
# HMT's Basis stores the same), seed (APOLLO: the seed of the next refresh), limiter (APOLLO's remembered update
# norm) and, for HMT, rank.

Snapshot = dict  # {"params": {name: Tensor}, "state": {name: {"step": int, "m": Tensor, ...}}}


def _reference_param_state(st: dict) -> dict | None:
    """The common-format state of a torch.optim.AdamW / galore-torch GaLoreAdamW / apollo-torch APOLLOAdamW
    parameter (keys step, exp_avg, exp_avg_sq, projector.ortho_matrix, projector.seed, scaled_grad)."""
    if "exp_avg" not in st:
        return None
    out = {"step": int(st["step"]), "m": st["exp_avg"].detach().clone(), "v": st["exp_avg_sq"].detach().clone()}
    projector = st.get("projector")
    if projector is not None:
        out["basis"] = projector.ortho_matrix.detach().clone()
        if hasattr(projector, "svd_count"):  # apollo-torch's GradientProjector (seeded random basis)
            out["seed"] = int(projector.seed)
    if "scaled_grad" in st:
        out["limiter"] = st["scaled_grad"].detach().clone()
    return out


def reference_snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    params = dict(model.named_parameters())
    state = {n: _reference_param_state(opt.state.get(p, {})) for n, p in params.items()}
    return {"params": {n: p.detach().clone() for n, p in params.items()},
            "state": {n: st for n, st in state.items() if st is not None}}


def hmt_snapshot(method, model: nn.Module) -> Snapshot:
    """An HMT run as the reference (per-layer vs ordinary step): the common format for the comparisons, plus HMT's
    own serialization (``LowRankOptimizer.state_dict``: every slot field the library keeps, whatever it adds) for
    ``force_state`` and the rank history so far."""
    state = {}
    for s in method.opt.slots:
        if s.m is None:
            continue
        st = {"step": s.clock.step, "m": s.m.detach().clone(), "v": s.v.detach().clone(), "seed": s.seed, "rank": s.rank}
        if s.basis is not None:
            st["basis"] = (s.basis.left if s.basis.left is not None else s.basis.right).detach().clone()
        if s.limiter_prev is not None:
            st["limiter"] = s.limiter_prev.detach().clone()
        state[s.name] = st
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "state": state,
            "hmt": copy.deepcopy(method.opt.state_dict()), "rank_history": method.summary()["rank/history"]}


def record(snapshot: Callable[[], Snapshot], step: Callable[[Tensor], object], data: Sequence[Tensor]) \
        -> tuple[list[Snapshot], list[object]]:
    """Run the reference over ``data``: (snapshots before each step and after the last, what each step returned)."""
    snaps, outs = [snapshot()], []
    for x in data:
        outs.append(step(x))
        snaps.append(snapshot())
    return snaps, outs


def _basis_tensor(s) -> Tensor:
    return s.basis.left if s.basis.left is not None else s.basis.right


def _into(dst: Tensor, src: Tensor, what: str) -> None:
    """Copy values in place, keeping HMT's own dtype and memory layout (so HMT runs its own code path)."""
    if dst.shape != src.shape:
        raise AssertionError(f"{what}: HMT shape {tuple(dst.shape)} vs reference {tuple(src.shape)}")
    dst.copy_(src)


@torch.no_grad()
def force_state(method, model: nn.Module, snap: Snapshot) -> None:
    """Put HMT (``method`` attached to ``model``) into the snapshot's state: parameters, Adam moments (rounded to
    HMT's state dtype), step counters, projection basis, APOLLO's next seed and limiter memory. Values are copied
    into HMT's own tensors (HMT's dtype and memory layout). Before the first step there is no optimizer state.
    Both HMT step counters (``step``: refresh schedule, ``adam_t``: bias correction) get the reference's step.
    An HMT snapshot is loaded with ``LowRankOptimizer.load_state_dict`` (HMT's exact-resume path)."""
    for n, p in model.named_parameters():
        p.copy_(snap["params"][n])
    if "hmt" in snap:  # an HMT reference: its own state_dict (the per-layer engine's lagged clip stays HMT's own)
        method.opt.load_state_dict(snap["hmt"])
        return
    for s in method.opt.slots:
        st = snap["state"].get(s.name)
        if (st is None) != (s.m is None):
            raise AssertionError(f"{s.name}: optimizer state on one side only (replay from the first snapshot)")
        if st is None:
            continue
        s.clock.step = s.clock.adam_t = st["step"]
        _into(s.m, st["m"], f"{s.name} m")
        _into(s.v, st["v"], f"{s.name} v")
        if "basis" in st:
            _into(_basis_tensor(s), st["basis"], f"{s.name} basis")
        if "seed" in st:
            s.seed = st["seed"]
        if "limiter" in st:
            s.limiter_prev = st["limiter"].clone()


def state_rows(method, snap: Snapshot, step: int) -> dict[str, list[tuple[str, Tensor, Tensor]]]:
    """(name, HMT, reference) rows per kind of state for ``assert_tensors_close``: "moments" (m and v) and
    "limiter". Which parameters have state, step counters, APOLLO seeds and ranks must agree exactly (asserted
    here, failing with "step {step}: ..."). Bases are checked where they are computed (``replay``)."""
    rows: dict[str, list] = {"moments": [], "limiter": []}

    def require(ok: bool, msg: str) -> None:
        if not ok:
            raise AssertionError(f"step {step}: {msg}")

    for s in method.opt.slots:
        st = snap["state"].get(s.name)
        require((st is None) == (s.m is None), f"{s.name}: optimizer state on one side only")
        if st is None:
            continue
        require(s.clock.step == s.clock.adam_t == st["step"],
                f"{s.name}: HMT step {s.clock.step}/{s.clock.adam_t}, reference {st['step']}")
        for key in ("seed", "rank"):
            if key in st:
                require(getattr(s, key) == st[key], f"{s.name}: {key} {getattr(s, key)} vs {st[key]}")
        rows["moments"] += [(f"{s.name} m", s.m, st["m"]), (f"{s.name} v", s.v, st["v"])]
        require(("limiter" in st) == (s.limiter_prev is not None), f"{s.name}: limiter memory on one side only")
        if "limiter" in st:
            rows["limiter"].append((f"{s.name} limiter", s.limiter_prev, st["limiter"]))
    return rows


def update_rows(model: nn.Module, before: Snapshot, after: Snapshot) -> list[tuple[str, Tensor, Tensor]]:
    """(name, HMT's update, the reference's update) of one step from ``before``: W_{k+1} − W_k on each side."""
    return [(n, p.detach() - before["params"][n], after["params"][n] - before["params"][n])
            for n, p in model.named_parameters()]


class _Refreshes:
    """Wraps ``method.opt.refresh`` (every refresh goes through it: ordinary step and per-layer hooks). HMT computes
    its own basis, which is kept for the check (with the fp32 singular values of the gradient it came from); then
    HMT continues with the reference's basis after this step (``after``), copied into HMT's tensor. So the update
    check does not depend on how an SVD rounds, and the basis check can allow for the SVD's conditioning."""

    def __init__(self, method) -> None:
        self.refresh = method.opt.refresh
        self.after: Snapshot | None = None
        self.step = 0
        self.computed: dict[str, tuple] = {}  # name -> (HMT's new basis, σ of the gradient, is a left basis P)
        method.opt.refresh = self._refresh

    def _refresh(self, s, grad: Tensor) -> None:
        self.refresh(s, grad)
        st = self.after["state"].get(s.name, {})
        if "basis" not in st:
            return
        mine = _basis_tensor(s)
        left = s.basis.right is None  # Qᵀ (r, in): vectors are rows; P (out, r): columns
        self.computed[s.name] = (mine.detach().clone(), torch.linalg.svdvals(grad.detach().float()), left)
        if mine.shape != st["basis"].shape:
            raise AssertionError(f"step {self.step}: {s.name}: HMT's new basis has shape {tuple(mine.shape)}, "
                                 f"the reference's {tuple(st['basis'].shape)}")
        with torch.no_grad():
            mine.copy_(st["basis"])


def replay(method, model: nn.Module, step: Callable[[Tensor], object], data: Sequence[Tensor],
           snaps: Sequence[Snapshot], check: Callable[[int, object, dict], None]) -> None:
    """Teacher forcing: for each k, put HMT into ``snaps[k]`` (``force_state``), run HMT's step ``step(data[k])``
    (its own forward, backward and update; per-layer HMT updates inside backward), then
    ``check(k, returned, refreshed)`` compares HMT with ``snaps[k + 1]``. With identical parameters and input both
    sides' backward passes compute the same gradient, so what differs is only the optimizers' arithmetic in one
    step. At a basis refresh HMT computes its own basis (``refreshed``: name -> (HMT's basis, singular values of
    the gradient), for ``assert_bases_close``) and then takes the step with the reference's new basis."""
    refreshes = _Refreshes(method)
    for k, x in enumerate(data):
        force_state(method, model, snaps[k])
        refreshes.after, refreshes.step, refreshes.computed = snaps[k + 1], k, {}
        check(k, step(x), refreshes.computed)


U32 = 2.0 ** -24  # unit roundoff of float32


def assert_bases_close(refreshed: dict[str, tuple], before: Snapshot, after: Snapshot, *, source: str,
                       step: int, random_rtol: float = 1e-6) -> None:
    """HMT refreshed the bases of exactly the parameters whose basis the reference replaced in this step
    (``before`` → ``after``), and its freshly computed bases (``replay``'s ``refreshed``) equal the reference's new
    ones; one table on failure.

    ``source="random"`` (seeded Gaussian): the same draws on both sides, element-wise ``random_rtol``.
    ``source="svd"`` (SVD / randomized SVD): singular vectors are defined up to sign, and only as well as the
    spectrum separates them. Each vector i is sign-aligned with the reference's and must satisfy
    ``‖a_i − b_i‖ ≤ n·u·(1 + σ₁/gap_i)``: both sides factor the gradient in float32 (u = 2⁻²⁴); a backward-stable
    SVD is exact for a perturbation ‖E‖ ≲ n·u·σ₁ (n = the longer side of G), which by Davis–Kahan/Wedin moves the
    i-th singular vector by ≲ ‖E‖/gap_i, gap_i = the distance of σ_i to its neighbours σ_{i±1} (σ_{r+1} included:
    the truncation edge). A wrong subspace, rank or order is an O(1) difference where vectors are separated."""
    def basis(snap: Snapshot, name: str) -> Tensor | None:
        return snap["state"].get(name, {}).get("basis")

    replaced = {n for n in after["state"] if basis(after, n) is not None
                and (basis(before, n) is None or not torch.equal(basis(before, n), basis(after, n)))}
    if set(refreshed) != replaced:
        def names(ns: set[str]) -> str:
            return f"{len(ns)} ({', '.join(sorted(ns)[:3])}{', ...' if len(ns) > 3 else ''})"
        raise AssertionError(f"step {step}: HMT computed a new basis for {names(set(refreshed))}, the reference for "
                             f"{names(replaced)}")
    rows = []
    for name, (mine, sigma, left) in refreshed.items():
        ref = basis(after, name)
        if source == "random":
            d, bound = (mine.double() - ref.double()).abs(), random_rtol * ref.double().abs()
            if bool((d > bound).any()):
                rows.append((name, "all", f"{float(d.max()):.3e} (max element)", f"rtol {random_rtol:.0e}", ""))
            continue
        a, b = (mine.double().t(), ref.double().t()) if left else (mine.double(), ref.double())  # (r, n): rows
        sig, n = sigma.double(), max(mine.shape)
        for i in range(a.shape[0]):
            gap = min((abs(float(sig[i] - sig[j])) for j in (i - 1, i + 1) if 0 <= j < sig.numel()),
                      default=float(sig[0]))
            ratio = float(sig[0]) / gap if gap > 0 else float("inf")
            tol = n * U32 * (1 + ratio)
            err = float(((1.0 if float(a[i] @ b[i]) >= 0 else -1.0) * a[i] - b[i]).norm())
            if err > tol:
                rows.append((name, str(i), f"{err:.3e}", f"{tol:.3e}", f"{ratio:.3g}"))
    if not rows:
        return
    head = ("basis", "vector i", "‖a_i - b_i‖ (sign-aligned)", "tolerance", "σ₁/gap_i")
    table = [head, *rows]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in table]
    raise AssertionError(f"step {step}: {len(rows)} basis vector(s) differ from the reference's "
                         f"(a = HMT, b = reference):\n" + "\n".join(lines))


def lm_step(model: nn.Module, step: Callable[[], object], zero: Callable[[], None],
            start: Callable[[int, int], None] | None = None, micro: int = 1) -> Callable[[Tensor], object]:
    """``x ↦`` one training step of a causal LM on token batch ``x`` (next-token cross-entropy), in ``micro``
    micro-batches (loss / micro each); returns what ``step()`` returns (HMT: the global gradient norm)."""
    def run(x: Tensor) -> object:
        for i, chunk in enumerate(x.chunk(micro)):
            if start is not None:
                start(i, micro)
            (model(input_ids=chunk, labels=chunk).loss / micro).backward()
        out = step()
        zero()
        return out

    return run


# A free TCP port for a gloo rendezvous or torchrun's --master_port. Drawn below Linux's ephemeral range
# (32768-60999), so no outgoing connection (gloo's own, another test's) can be given it between this check and
# the rendezvous; each pytest-xdist worker (gw0, gw1, ...) draws from its own block of 1,000, so two workers of one
# session never pick the same port. The offset by process id separates concurrent sessions.
_PORTS = itertools.count(os.getpid() % 1000)


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # unset in a serial run
    base = 20000 + 1000 * (int(worker[2:]) % 12 if worker[2:].isdigit() else 0)
    for _ in range(1000):
        port = base + next(_PORTS) % 1000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT after an earlier test's rendezvous
                continue
            return port
    raise RuntimeError(f"no free TCP port in {base}-{base + 999}")


def join_gloo(rank: int, world: int, port: int, timeout_s: float | None = None) -> None:
    """A spawned test worker joins a ``world``-process gloo group on localhost:``port`` with one torch thread.
    ``timeout_s``: a short collective timeout, so a shape mismatch between ranks fails the test instead of hanging."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)


def spawn_gloo(worker: Callable, args: tuple, nprocs: int) -> None:
    """``mp.spawn(worker, args, nprocs)``, and each process then releases its process groups
    (``experiments.dist.context.release_process_groups``) once ``worker``'s frame, with the models and wrappers
    that hold them, is gone: gloo's threads are joined before the interpreter finalizes, not during it (SIGABRT)."""
    import torch.multiprocessing as mp

    mp.spawn(_then_release_process_groups, args=(worker, *args), nprocs=nprocs, join=True)


def _then_release_process_groups(rank: int, worker: Callable, *args) -> None:
    from experiments.dist.parallel import release_process_groups

    try:
        worker(rank, *args)
    finally:
        release_process_groups()


def seeded_token_batches(steps: int, batch: int = 4, seq: int = 16, vocab: int = 256) -> list[torch.Tensor]:
    """The distributed workers' global batches: ``steps`` × (batch, seq) token ids from generator seed 7."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]


def sgd_hook(param: torch.Tensor) -> None:
    """A post-accumulate-grad hook that takes one SGD step (lr 0.1) without autograd: ``mul`` + ``add_``."""
    with torch.no_grad():
        param.add_(param.grad * -0.1)
