"""Time and gradient-energy models of the planner, and the assembly of its integer program from measured costs.

Step time (a stated model; only differences between choices matter, and only after the micro-batch, loss and energy):
  recompute of a region   t = FLOPs(region forward) / F  +  bytes(region's saved tensors) / BW
  a codec (int8, fp8, …)  t = bytes(saved tensors) × c_codec        (encode in forward + decode in backward)
  layer recomputation     t = FLOPs(decoder layer forward) × L / F  +  bytes(layer saves) / BW
FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on a traced 1-layer forward (fake tensors; the
attention core by torch's SDPA formula, which ignores causality: an upper bound), bytes are the reference's
measured saved bytes per component. F (matmul FLOP/s in the model dtype), BW (copy bandwidth) and c_codec
(seconds per input byte of encode + decode with ``hmt_core.activations.codecs``) are measured by ``calibrate`` on
this machine in well under a second; ``python -m experiments.plan --calibrate device=cuda`` measures them on a GPU
and writes a file that ``calibration=<file>`` feeds back (the hook for GPU plans).

Retained gradient energy: the fraction of each weight's gradient energy ‖G‖²_F in the subspace where the optimizer
keeps its moments. For a rank-r projection of a (m × n) gradient, k = min(m, n), the top-r SVD subspace captures
at least r/k (Eckart–Young: the r largest of k squared singular values hold at least r/k of their sum) and a
random r-dimensional subspace r/k in expectation, so e = min(1, r/k) is a guaranteed bound before any gradient is
seen; dense AdamW keeps all (e = 1); APOLLO-Mini (Mode B, rank 1) 1/k. The objective is the parameter-weighted
mean over all trainable weights, with the ranks each traced optimizer sample actually held: under
``method.state_budget`` HMT's allocator (``hmt_core.rank_budget``) chooses per-layer ranks within the budget at
every refresh, and a dry run, having no spectra, allocates by E(r) = r/k — the same bound. So the planner chooses
a state *budget* (a fraction of AdamW's state), not per-layer ranks: before training every layer of a type has the
same cost and the same bound, and the per-layer split is better left to the allocator, which sees the spectra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import statistics
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments import methods
from experiments.loop import autocast_context
from experiments.models import build_model
from experiments.planner.costs import (
    Derived,
    GIB,
    PHASES,
    Space,
    all_options,
    layer_variants,
    opt_key,
    option_cost,
    valid_actions,
)
from experiments.planner import prices
from experiments.planner.deferred import deferred_excess_gib
from experiments.planner.efficiency import Throughput
from experiments.planner.problem import Action, KEEP, Option, Problem, Segment
from experiments.planner.streaming import Streaming
from experiments.planner.vocab import from_record
from hmt_core.activations.apply import llama_scopes
from hmt_core.activations.codecs import decode, encode
from hmt_core.activations.policy import COMPONENTS, LAYER_COMPONENTS

LOSSY_ACTIONS = ("int8", "fp8", "int4_outlier", "int8_outlier")


# ---- calibration ---------------------------------------------------------------------------------------------------
def _timed(fn, device: torch.device, reps: int = 3) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(device: str = "cpu", dtype: torch.dtype = torch.bfloat16, codecs: tuple[str, ...] = ("int8", "fp8"),
              block: int = 128) -> dict:
    """F (FLOP/s), BW (bytes/s) and seconds per input byte of each codec, measured on ``device``."""
    dev = torch.device(device)
    n = 1024 if dev.type == "cuda" else 384
    a = torch.randn(n, n, device=dev).to(dtype)
    flops = 2 * n**3 / _timed(lambda: a @ a, dev)
    x = torch.randn(1 << 22 if dev.type == "cuda" else 1 << 20, device=dev).to(dtype)
    bandwidth = 2 * x.numel() * x.element_size() / _timed(lambda: x.clone(), dev)
    codec_s = {c: _timed(lambda c=c: decode(encode(x, c, block=block)), dev) / (x.numel() * x.element_size())
               for c in codecs}
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"device": name, "flops_per_s": flops, "bytes_per_s": bandwidth, "codec_s_per_byte": codec_s}


# ---- FLOPs and weights of the model ----------------------------------------------------------------------------------
def region_flops(run) -> dict[str, float]:
    """Forward FLOPs per sequence of each recomputable region of one decoder layer and of the LM head."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop

    aten = torch.ops.aten
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu.default: sdpa_flop}
    with layer_variants(run) as with_layers, contextlib.redirect_stderr(io.StringIO()), FakeTensorMode():
        r = with_layers(1)
        model = build_model(r.model, device="cpu")
        ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (1, r.train.seq_len))
        counter = FlopCounterMode(display=False, custom_mapping=mapping)
        with counter, autocast_context(torch.device("cpu"), r.train.autocast):
            model(input_ids=ids, labels=ids)
    counts = counter.get_flop_counts()

    def total(suffix: str, op=None) -> float:
        keys = [k for k in counts if k.endswith(suffix)]
        if not keys:
            return 0.0
        ops = counts[min(keys, key=len)]
        return float(sum(v for o, v in ops.items() if op is None or str(o).startswith(op)))

    core = total(".layers.0.self_attn", "aten._scaled_dot_product") + total(".layers.0.self_attn", "aten.bmm")
    attn, o_proj = total(".layers.0.self_attn"), total(".layers.0.self_attn.o_proj")
    return {"attn_qkv": attn - o_proj - core, "attn_core": core, "attn_out": o_proj,
            "mlp_intermediate": total(".layers.0.mlp"), "norm": 0.0, "lm_head": total("lm_head"),
            "layer": total(".layers.0")}


def weight_stats(run, weight_dtypes: tuple[str, ...] = ("bf16",)) -> dict:
    """Per model depth L ∈ {1, 2} (built on fake tensors): every trainable weight's (elements, min side), whether
    the model is Llama-shaped (activation policy components), and the parameter bytes per ``method.weight_dtype``
    (INT8 weights after ``prepare``: codes + scales) — the weights' floor."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    out = {}
    with layer_variants(run) as with_layers, contextlib.redirect_stderr(io.StringIO()), FakeTensorMode():
        for layers in (1, 2):
            model = build_model(with_layers(layers).model, device="cpu")
            shapes = {n: [p.numel(), min(p.shape) if p.dim() == 2 else 1]
                      for n, p in model.named_parameters() if p.requires_grad}
            nbytes = {"bf16": _param_bytes(model)}
            llama = _is_llama(model)
            if "int8" in weight_dtypes:
                method = methods.make_method(dataclasses.replace(run.method, weight_dtype="int8"))
                nbytes["int8"] = _param_bytes(method.prepare(model))
            out[f"L{layers}"] = {"weights": shapes, "param_bytes": nbytes, "llama": llama}
    return out


def int8_table_bytes(run, weight_dtype: str) -> list[int] | None:
    """Parameter bytes of the 1- and 2-layer models (fake tensors) with INT8 embedding and LM head and the projected
    weights in ``weight_dtype``, as ``method.prepare`` stores them; None when the model refuses INT8 tables (tied)."""
    out = []
    with layer_variants(run) as with_layers, contextlib.redirect_stderr(io.StringIO()), FakeTensorMode():
        for layers in (1, 2):
            method = methods.make_method(dataclasses.replace(run.method, embedding_dtype="int8",
                                                             weight_dtype=weight_dtype))
            try:
                out.append(_param_bytes(method.prepare(build_model(with_layers(layers).model, device="cpu"))))
            except ValueError:
                return None
    return out


def _param_bytes(model) -> int:
    """Bytes of the parameters' storages (a tied weight is listed once; an INT8 layer's phantom is one element)."""
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def _is_llama(model) -> bool:
    return llama_scopes(model) is not None


def energy(stats: dict, record: dict, name: str, layers: int) -> float:
    """Parameter-weighted retained-energy bound (module docstring) of the optimizer sample ``name``, from the rank
    each projected weight held in its traced step, at ``layers`` decoder layers."""
    sample = record["samples"][name]

    def at(key: str) -> tuple[float, float]:
        ranks = next(v for k, v in sample.items() if k.startswith(f"{key}b"))["ranks"]
        kept = total = 0.0
        for weight, (n, k) in stats[key]["weights"].items():
            total += n
            kept += n * min(1.0, ranks[weight] / k) if weight in ranks else n
        return kept, total

    (k1, t1), (k2, t2) = at("L1"), at("L2")
    return (k1 + (layers - 1) * (k2 - k1)) / (t1 + (layers - 1) * (t2 - t1))


def param_bytes(stats: dict, layers: int, weight_dtype: str = "bf16") -> int:
    b1, b2 = stats["L1"]["param_bytes"][weight_dtype], stats["L2"]["param_bytes"][weight_dtype]
    return b1 + (layers - 1) * (b2 - b1)


# ---- the integer program --------------------------------------------------------------------------------------------
def action_time(component: str, action: str, d: Derived, flops: dict, cal: dict) -> float:
    """Seconds per sequence that ``action`` adds to a step (module docstring)."""
    saved = d.keep_saved.get(component, 0.0) * GIB
    if action == "recompute":
        per_layer = component not in ("lm_head", "norm")
        return (d.layers if per_layer else 1) * flops.get(component, 0.0) / cal["flops_per_s"] \
            + saved / cal["bytes_per_s"]
    codec = cal["codec_s_per_byte"]
    return saved * codec.get(action, max(codec.values()))


def build_problem(d: Derived, *, space: Space, record: dict, stats: dict, flops: dict, cal: dict,
                  budget_gib: float, llama: bool, seq_scale: float = 1.0,
                  throughput: Throughput | None = None, streaming: Streaming | None = None) -> Problem:
    """The MILP of ``experiments.planner.milp`` from measured costs and the lossy choices' loss prices
    (``experiments.planner.prices``). ``seq_scale``: per-sequence bytes and times scaled for a sequence
    ``seq_scale`` times the measured one (capacity's sequence-length search); ``throughput``: the micro-batch
    efficiency model (None: the largest micro-batch that fits); ``streaming``: what a streamed option changes
    (``experiments.planner.streaming``; needed when the space offers ``weight_offloads=[host]``)."""
    options = []
    streamed = {} if streaming is None else {
        w: (streaming.delta(stats, d.layers, w), streaming.tokens(stats, d.layers, w))
        for w in space.weight_dtypes if w in stats["L1"]["param_bytes"]}  # per weight dtype: BF16, INT8
    for choice in all_options(space, from_record(record)):
        lossy = (int(choice.dtype == "bf16") + int(choice.dense_8bit) + int(choice.weights == "int8")
                 + int(choice.head) + choice.vocab.lossy)  # a projected head keeps low-rank moments: lossy
        sample = f"opt:{choice.mode}:{choice.dtype}:{choice.budget:g}:int8" \
            if choice.weights == "int8" and not choice.head else opt_key(choice)
        cost = option_cost(d, choice, space)
        if choice.mode == "A":  # the deferred low-rank update, hidden at 1-2 layers (experiments.planner.deferred)
            cost = {**cost, "optimizer": cost["optimizer"] + deferred_excess_gib(record, stats, sample, d.layers)}
        transfer = 0.0
        if choice.offload == "host":  # the streamed weights leave the device; the micro-batch waits for PCIe
            delta, transfer = streamed[choice.weights]
            cost = {p: v + delta[p] for p, v in cost.items()}
        options.append(Option(choice.label(), cost, energy(stats, record, sample, d.layers), lossy, choice,
                              loss=prices.total(prices.option_prices(choice)), transfer=transfer))
    zero = {p: 0.0 for p in PHASES}
    actions: dict[str, dict[str, Action]] = {}
    if llama:
        for c in COMPONENTS:
            actions[c] = {KEEP: Action()}
            for a in valid_actions(c, space):
                over = "act:attn_core:recompute" if (c, a) == ("attn_qkv", "recompute") else None
                actions[c][a] = _action(d, f"act:{c}:{a}", over, action_time(c, a, d, flops, cal),
                                        int(a in LOSSY_ACTIONS), seq_scale,
                                        prices.action_price(a).cost if a in LOSSY_ACTIONS else 0.0)
    layer = None
    if llama and "act:layer_recompute" in d.act:
        saved = sum(d.keep_saved.get(c, 0.0) for c in (*LAYER_COMPONENTS, "norm")) * GIB
        t = d.layers * flops.get("layer", 0.0) / cal["flops_per_s"] + saved / cal["bytes_per_s"]
        layer = _action(d, "act:layer_recompute", None, t, 0, seq_scale)
    codecs = layer_codecs(d, space, cal, seq_scale) if layer is not None else {}
    requires = ((("attn_qkv", "recompute"), ("attn_core", "recompute")),)
    base = tuple(Segment(start, {p: static.get(p, 0.0) for p in zero},
                         {p: per_seq.get(p, 0.0) * seq_scale for p in zero}) for start, static, per_seq in d.base)
    return Problem(budget=budget_gib, base=base, options=options,
                   actions=actions, layer_recompute=layer, layer_components=(*LAYER_COMPONENTS, "norm"),
                   requires=requires, max_batch=space.max_batch_size, layer_codecs=codecs,
                   layer_keep=KEEP in space.layer_inputs or not codecs, throughput=throughput)


def layer_codecs(d: Derived, space: Space, cal: dict, seq_scale: float) -> dict[str, Action]:
    """Each layer-input codec under full layer recomputation: its measured delta over layer recomputation alone,
    the codec's time on the layer inputs' bytes (encode in forward, decode before the recompute)."""
    codec_s = cal["codec_s_per_byte"]
    out = {}
    for codec in space.layer_inputs:
        name = f"act:layer_recompute:{codec}"
        if codec != KEEP and name in d.act:
            t = d.layer_inputs * GIB * codec_s.get(codec, max(codec_s.values()))
            out[codec] = _action(d, name, "act:layer_recompute", t, int(codec in LOSSY_ACTIONS), seq_scale,
                                 prices.layer_codec_price(codec).cost)
    return out


def _action(d: Derived, name: str, over: str | None, t: float, lossy: int, seq_scale: float,
            loss: float = 0.0) -> Action:
    """The measured delta of sample ``name`` (static, per sequence; less sample ``over``'s where given, on the same
    line), on the main line and on each line of the reference it was traced on (``Derived.act_lines``);
    per-sequence bytes and time scale with the sequence length."""
    def scaled(delta, minus):
        if delta is None or (over is not None and minus is None):
            return None
        if minus is not None:
            delta = tuple({p: x[p] - y.get(p, 0.0) for p in x} for x, y in zip(delta, minus))
        static, per_seq = delta
        return ({**static, "probe": static.get("probe", 0.0) * min(1.0, seq_scale)},
                {p: v * seq_scale for p, v in per_seq.items()})

    over_main = d.act.get(over) if over is not None else None
    if over is not None and over_main is None:  # nothing to subtract (e.g. the core's recompute not offered)
        over = None
    static, per_seq = scaled(d.act[name], over_main)
    lines = d.act_lines.get(name, [])
    minus = d.act_lines.get(over, [None] * len(lines)) if over is not None else [None] * len(lines)
    return Action(static=static, per_seq=per_seq, time=t * seq_scale, lossy=lossy, loss=loss,
                  lines=tuple(scaled(x, y) for x, y in zip(lines, minus)))

