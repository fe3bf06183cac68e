"""Byte costs for the memory planner, measured by the dry-run meter on traced 1- and 2-layer models.

Every byte the planner's integer program (``experiments.planner.milp``) counts comes from ``experiments.dryrun.
trace_steps`` — the real training step on ``FakeTensorMode`` tensors under the project's meter — run on the
model at its full width with 1 and 2 decoder layers (at the micro-batches of ``batch_segments``), never from a
formula.
Per traced configuration (a *sample*) the meter's peak of each phase (forward, backward, optimizer) and the
activation probe's peak (``probe``) are kept, plus the policy's per-component saved bytes.

Differencing (each choice's bytes are its measured difference from a reference):
  reference  R(L, b): all activations kept, the first optimizer option; phase peaks at L ∈ {1, 2} and the
             micro-batches of ``batch_segments``; in L by lin(v1, v2; L) = v1 + (L − 1)(v2 − v1) (each extra
             layer adds the same bytes), in b by lines through pairs of measured micro-batches
  an activation choice (component c, action a): S − R at L ∈ {1, 2} and the main pair (b_a, b_b), a line in b
  an optimizer sample (state budget × LM head, 8-bit dense state, INT8 weights): S − R at b_a, static
  a vocabulary setting (INT8 embedding and head, row updates, in-loss head; ``experiments.planner.vocab``): its
             sample minus the same optimizer sample with the default vocabulary, at b_a, static
  a layer-input codec under full layer recomputation: S(layers recomputed, inputs coded) − S(layers recomputed),
             a line in b as the activation choices; traced at L ∈ {2, 3} (``sample_depths``).
The reference keeps everything with ``offload_cpu``, which on the CPU a dry run traces leaves each saved tensor
where it is (``hmt_core.activations.apply``: ``packed = t`` on CPU) — byte-identical to ``keep`` — but makes the
policy non-identity, so the policy counts what each component saves and the activation probe is traced too.
Samples come from the committed cost table or the user's cache (``experiments.planner.cache``), keyed by what changes a
trace; missing ones are traced and cached one by one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from experiments import methods
from experiments.config import RunConfig
from experiments.dryrun import trace_steps
from experiments.memory.gpu_allowance import traced_step_bytes
from experiments.models import load_hf_config
from experiments.planner.cache import Table, entry_key
from experiments.planner.deferred import deferred_settings
from experiments.planner.segments import batch_segments
from experiments.planner.space import (  # noqa: F401 (Space, all_options, opt_key, Vocab: the planner's API here)
    OptChoice,
    Space,
    Vocab,
    all_options,
    base_choice,
    families,
    opt_key,
    opt_pieces,
)
from experiments.planner.tracing import trace_points
from experiments.planner.vocab import Combo, to_record, vocab_delta, vocab_pieces
from hmt_core.activations.policy import ActivationPolicy, COMPONENTS, LAYER_COMPONENTS

GIB = 2**30
STEP_PHASES = ("forward", "backward", "optimizer")
PHASES = (*STEP_PHASES, "probe")
KEEP_COUNTED = "offload_cpu"  # keep, but counted by the policy (see the module docstring)
NO_RECOMPUTE = ("embedding", "residual")  # policy.py: the embedding saves only indices; residual via layers


def valid_actions(component: str, space: Space) -> tuple[str, ...]:
    return tuple(a for a in space.actions if a != "keep" and not (a == "recompute" and component in NO_RECOMPUTE))


def policy_for(base: ActivationPolicy, llama: bool, **changes) -> ActivationPolicy:
    """The reference policy (every component kept, counted) with ``changes``; identity for non-Llama models."""
    if not llama:
        return base.replace(**{c: "keep" for c in COMPONENTS}, layer_recompute=False)
    actions = {c: KEEP_COUNTED for c in COMPONENTS}
    if changes.get("layer_recompute"):
        actions.update({c: "keep" for c in LAYER_COMPONENTS})
    actions.update({k: v for k, v in changes.items() if k in COMPONENTS})
    return base.replace(**actions, layer_recompute=bool(changes.get("layer_recompute", False)))


def act_pieces(space: Space, llama: bool) -> dict[str, dict]:
    """Activation samples: one component changed at a time (``attn_qkv=recompute`` with its required
    ``attn_core=recompute``), full layer recomputation, and with it each layer-input codec
    (``activation.residual``)."""
    if not llama:
        return {}
    out = {}
    for c in COMPONENTS:
        for a in valid_actions(c, space):
            out[f"act:{c}:{a}"] = {c: a, **({"attn_core": "recompute"} if (c, a) == ("attn_qkv", "recompute")
                                           else {})}
    if True in space.layer_recompute:
        out["act:layer_recompute"] = {"layer_recompute": True}
        for codec in space.layer_inputs:
            if codec != "keep":
                out[f"act:layer_recompute:{codec}"] = {"layer_recompute": True, "residual": codec}
    return out


# ---- tracing -----------------------------------------------------------------------------------------------------
def target_layers(run: RunConfig) -> int:
    if run.model.hf_dir:
        return int(load_hf_config(run.model.hf_dir).num_hidden_layers)
    return run.model.num_layers


@contextlib.contextmanager
def layer_variants(run: RunConfig):
    """``with_layers(L)``: ``run``'s model with L decoder layers (a ``model.path`` config is copied with
    ``num_hidden_layers`` changed into a temporary directory)."""
    with tempfile.TemporaryDirectory(prefix="hmt-plan-") as tmp:
        def with_layers(layers: int) -> RunConfig:
            if not run.model.hf_dir:
                return dataclasses.replace(run, model=dataclasses.replace(run.model, num_layers=layers))
            folder = Path(tmp) / f"L{layers}"
            if not folder.exists():
                config = load_hf_config(run.model.hf_dir)
                config.num_hidden_layers = layers
                types = getattr(config, "layer_types", None)  # per-layer attention kinds (Gemma 2, Qwen2): cut too
                if types:
                    config.layer_types = [types[i % len(types)] for i in range(layers)]
                config.save_pretrained(folder)
            return dataclasses.replace(run, model=dataclasses.replace(run.model, path=str(folder), card=None))

        yield with_layers


def trace_sample(run: RunConfig, *, step_bytes: bool = False) -> dict:
    """One dry-run trace (``trace_steps``): each phase's peak, the probe's, the policy's saved bytes by
    component, the bytes of parameters and optimizer state at the end, and the rank each projected weight holds;
    ``step_bytes``: also the bytes a budget less the GPU allowance must hold (``gpu_allowance.traced_step_bytes``;
    not part of the cached cost samples, which do not depend on ``dryrun.reserve``)."""
    run = dataclasses.replace(run, mode="dryrun")
    with contextlib.redirect_stderr(io.StringIO()):
        traced = trace_steps(run, methods.make_method(run.method))
    rep = traced["report"]
    history = traced["method_summary"].get("rank/history", {})
    return {**{p: int(rep.peak_by_phase_bytes[p]) for p in STEP_PHASES}, "probe": traced["probe_peak_bytes"],
            "peak": int(rep.peak_bytes), **({"step_bytes": traced_step_bytes(run, traced)} if step_bytes else {}),
            "saved": traced["activation_saved_bytes"] or {},
            "params": int(rep.current_by_category_bytes["params"]),
            "optimizer_state": int(rep.current_by_category_bytes["optimizer"]),
            "ranks": {name: h[-1][1] for name, h in history.items() if h}}


def sample_plan(run: RunConfig, space: Space, llama: bool, vocab: dict[Combo, tuple[Vocab, ...]] | None = None
                ) -> list[tuple[str, OptChoice, dict, list[tuple[int, int]]]]:
    """The traced points: (sample name, optimizer choice, activation changes, [(layers, micro-batch), ...]);
    ``vocab``: the vocabulary settings the run admits (``experiments.planner.vocab.admissible``; None: none)."""
    base_opt = base_choice(*families(space)[0], space)
    segments = batch_segments(run, space.max_batch_size)
    batches = sorted({b for _, *bs in segments for b in bs})
    b_a, b_b = segments[-1][1:]  # the main regime: activation deltas are lines through these, options at b_a
    plan: list[tuple[str, OptChoice, dict, list[tuple[int, int]]]] = [
        ("ref", base_opt, {}, [(layers, b) for b in batches for layers in (1, 2)])]
    plan += [(name, choice, {}, [(1, b_a), (2, b_a)]) for name, choice in opt_pieces(space).items()
             if choice != base_opt]
    plan += [(name, choice, {}, [(1, b_a), (2, b_a)]) for name, choice in vocab_pieces(space, vocab or {}).items()]
    plan += [(name, base_opt, changes, [(n, b) for b in dict.fromkeys((b_a, b_b)) for n in sample_depths(name)])
             for name, changes in act_pieces(space, llama).items()]
    return plan


def sample_run(run: RunConfig, with_layers, layers: int, batch: int, choice: OptChoice, changes: dict,
               llama: bool) -> RunConfig:
    method = dataclasses.replace(run.method, **choice.method_changes(run.method))
    policy = policy_for(run.activation, llama, **changes)
    return dataclasses.replace(with_layers(layers), method=method, activation=policy,
                               train=dataclasses.replace(run.train, batch_size=batch))


def measure(run: RunConfig, space: Space, *, llama: bool, cache_dir: Path | None = None, refresh: bool = False,
            table=None, log: Callable[[str], None] = print, workers: int = 1,
            vocab: dict[Combo, tuple[Vocab, ...]] | None = None) -> dict:
    """All samples the planner needs for ``run`` (method=hmt; its other settings as given): from the committed cost
    table and the user's cache (``experiments.planner.cache``), traced (and cached at once) where missing or with
    ``refresh``; ``table``: an ``experiments.planner.cache.Table`` of ``run`` (else one over ``cache_dir``);
    ``workers``: processes the missing traces may use (``experiments.planner.tracing``); ``vocab``: as in
    ``sample_plan`` (kept in the record: the options ``build_problem`` offers). Returns the raw record:
    ``{"key", "layers", "segments", "samples": {name: {"L1b1": ...}}, ...}``."""
    table = table or Table(run, run.model.name, cache_dir)
    if refresh:  # measured again from scratch
        table.clear()
    segments = batch_segments(run, space.max_batch_size)
    b_a = segments[-1][1]
    base_opt = base_choice(*families(space)[0], space)
    plan = sample_plan(run, space, llama, vocab)
    start, total = time.perf_counter(), sum(len(points) for *_, points in plan)
    with layer_variants(run) as with_layers:
        points = [(name, layers, batch, sample_run(run, with_layers, layers, batch, choice, changes, llama))
                  for name, choice, changes, points in plan for layers, batch in points]
        keyed = [(name, layers, batch, r, entry_key(layers, batch, r.method, r.activation))
                 for name, layers, batch, r in points]
        found = {key: table.get(key) for *_, key in keyed}
        missing = {key: (name, layers, batch, r) for name, layers, batch, r, key in keyed if found[key] is None}
        traced = trace_missing(run, table, missing, found, workers=workers, log=log, start=start)
    samples: dict[str, dict] = {}
    for name, layers, batch, _, key in keyed:
        samples.setdefault(name, {})[f"L{layers}b{batch}"] = found[key]
    for name, choice in opt_pieces(space).items():
        if choice == base_opt:
            samples[name] = {k: v for k, v in samples["ref"].items() if k.endswith(f"b{b_a}")}
    log(f"costs: {total - traced} of {total} samples from the cost table"
        + (f", {traced} traced in {time.perf_counter() - start:.0f} s" if traced else ""))
    return {"key": table.key, "layers": target_layers(run), "seq_len": run.train.seq_len, "llama": llama,
            "space": dataclasses.asdict(space), "segments": segments, "samples": samples, "traces": traced,
            "deferred": deferred_settings(run),  # Mode A's updates wait for the clipping norm (None: they do not)
            "cached": total - traced, "trace_s": round(time.perf_counter() - start, 1),
            **({"vocab": to_record(vocab)} if vocab is not None else {})}


def trace_missing(run: RunConfig, table, missing: dict, found: dict, *, workers: int, log, start: float) -> int:
    """Trace ``missing`` ({entry key: (name, layers, batch, run)}), caching each in ``table`` and ``found`` as it
    finishes; returns how many were traced."""
    if not missing:
        return 0
    log(f"costs: tracing {len(missing)} small models (1-3 layers at full width, seq {run.train.seq_len}"
        + (f"; up to {workers} processes when long" if workers > 1 else "") + f"); each is cached in "
        f"{table.user_path or 'memory'} as soon as it is measured ...")
    traced = 0
    for key, hit in trace_points([(key, r) for key, (*_, r) in missing.items()], trace_sample, workers=workers,
                                 ready=table.get):
        name, layers, batch, _ = missing[key]
        table.put(key, hit, {"name": name, "layers": layers, "batch": batch})
        found[key], traced = hit, traced + 1
        if traced % 10 == 0:
            log(f"  [{traced} traced] {name} ({time.perf_counter() - start:.0f} s)")
    return traced


# ---- derived costs (pure functions of the record) ---------------------------------------------------------------
def sample_depths(name: str) -> tuple[int, int]:
    """The two depths a sample is traced at: 1 and 2 layers; a layer-input codec at 2 and 3: its forward peak over
    layer recomputation alone is +0.016 GiB at 1 layer, +0.032 at 2, then 0.015 less per further layer (1B shape,
    4 sequences, traced at 1, 2, 3, 4 and 6 layers; docs/planner.md), so only from 2 layers on is it a line."""
    return (2, 3) if name.startswith("act:layer_recompute:") else (1, 2)


def depths(sample: dict, batch: int) -> tuple[int, int]:
    """The depths ``sample`` holds at ``batch`` (``sample_depths``)."""
    held = (k[1:].split("b") for k in sample)
    return tuple(sorted(int(n) for n, b in held if int(b) == batch))[:2]


def traced_at(sample: dict, *batches: int) -> bool:
    """Whether ``sample`` holds both of its depths at every one of ``batches``."""
    return all(len(depths(sample, b)) == 2 for b in batches)


def lin(v1: float, v2: float, layers: int) -> float:
    """Value at ``layers`` of the line through (1, v1) and (2, v2): each layer adds the same bytes."""
    return v1 + (layers - 1) * (v2 - v1)


@dataclass(frozen=True)
class Derived:
    """Costs in GiB at the target depth: the reference's (start, static, per-sequence) bytes per phase for each
    batch segment; each activation choice's delta as static + per-sequence bytes (the probe's static); each
    optimizer sample's delta (static, measured at the main segment's first batch)."""

    layers: int
    base: list[tuple[int, dict[str, float], dict[str, float]]]
    act: dict[str, tuple[dict[str, float], dict[str, float]]] = field(default_factory=dict)  # (static, per_seq)
    opt: dict[str, dict[str, float]] = field(default_factory=dict)
    keep_saved: dict[str, float] = field(default_factory=dict)  # component -> GiB the reference saves (L layers)
    layer_inputs: float = 0.0  # GiB per sequence of the layer inputs full layer recomputation keeps (L layers)
    # name -> per line of ``base``: the delta over the reference on that line's micro-batches where the sample was
    # traced at both (``experiments.planner.extend``), else None (the main line's delta, ``act``, holds there)
    act_lines: dict[str, list[tuple[dict[str, float], dict[str, float]] | None]] = field(default_factory=dict)


def derive(record: dict, layers: int | None = None) -> Derived:
    layers = layers or record["layers"]
    s = record["samples"]
    ref = s["ref"]

    def at(sample: dict, phase: str, batch: int) -> float:
        lo, hi = depths(sample, batch)
        v1, v2 = sample[f"L{lo}b{batch}"][phase], sample[f"L{hi}b{batch}"][phase]
        if v1 is None or v2 is None:
            return 0.0
        return lin(v1, v2, layers - lo + 1) / GIB

    def line(sample: dict, b_a: int, b_b: int) -> tuple[dict[str, float], dict[str, float]]:
        per_seq = {p: (at(sample, p, b_b) - at(sample, p, b_a)) / max(1, b_b - b_a) for p in STEP_PHASES}
        return {p: at(sample, p, b_a) - b_a * per_seq[p] for p in STEP_PHASES}, per_seq

    base = []  # each secant holds from its own first micro-batch to the next line's (experiments.planner.segments)
    for _, b_a, b_b in record["segments"]:
        static, per_seq = line(ref, b_a, b_b)
        static["probe"], per_seq["probe"] = at(ref, "probe", b_a), 0.0
        base.append((b_a, static, per_seq))
    b_a, b_b = record["segments"][-1][1:]

    def delta(sample: dict, lo: int, hi: int) -> tuple[dict[str, float], dict[str, float]]:
        (st, ps), (rst, rps) = line(sample, lo, hi), line(ref, lo, hi)
        return ({**{p: st[p] - rst[p] for p in STEP_PHASES}, "probe": at(sample, "probe", lo) - at(ref, "probe", lo)},
                {p: ps[p] - rps[p] for p in STEP_PHASES})

    act = {n: delta(v, b_a, b_b) for n, v in s.items() if n.startswith("act:")}
    act_lines = {n: [delta(s[n], lo, hi) if traced_at(s[n], lo, hi) else None for _, lo, hi in record["segments"]]
                 for n in act}
    opt = {n: {p: at(v, p, b_a) - at(ref, p, b_a) for p in PHASES} for n, v in s.items()
           if n.startswith(("opt:", "vocab:"))}
    first = ref[f"L1b{b_a}"]["saved"], ref[f"L2b{b_a}"]["saved"]
    saved = {c: lin(first[0].get(c, 0), first[1].get(c, 0), layers) / GIB / b_a
             for c in sorted(set(first[0]) | set(first[1]))}
    lr = s.get("act:layer_recompute")
    inputs = 0.0 if lr is None else lin(*(lr[f"L{n}b{b_a}"]["saved"].get("residual", 0) for n in (1, 2)), layers)
    return Derived(layers, base, act, opt, saved, inputs / GIB / b_a, act_lines)


def option_cost(d: Derived, choice: OptChoice, space: Space) -> dict[str, float]:
    """Static GiB per phase of ``choice`` relative to the reference: its (budget, head) sample, plus the INT8-weight
    delta at its budget, the 8-bit delta measured at the family's first budget and its vocabulary setting's delta
    (``experiments.planner.vocab``)."""
    first = base_choice(choice.mode, choice.dtype, space).budget
    fam = f"opt:{choice.mode}:{choice.dtype}"
    parts = [d.opt[opt_key(choice)]]
    if choice.dense_8bit:
        parts.append(_minus(d.opt[f"{fam}:8bit:{'head' if choice.head else 'dense'}"],
                            d.opt[opt_key(choice, budget=first)]))
    if choice.weights == "int8":
        parts.append(_minus(d.opt[f"{fam}:{choice.budget:g}:int8"], d.opt[opt_key(choice, head=False)]))
    vocab = vocab_delta(d.opt, choice, space)
    if vocab is not None:
        parts.append(vocab)
    return {p: sum(x[p] for x in parts) for p in PHASES}


def _minus(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {p: a[p] - b[p] for p in PHASES}
