"""``mode=dryrun``: the real training step traced under ``FakeTensorMode`` — no memory, no values, same code.

Model construction, the method's ``prepare``/``attach`` (quantization, adapters, per-layer hooks), and
``dryrun.steps`` full optimizer steps (forward, backward, update) run on shape-only fake tensors with the meter in
``fake`` mode, so a 7B/13B step is measured on a machine with no GPU and 24 GiB of RAM. Anything that cannot be
traced (an op without a fake implementation) fails the run loudly; it never reports a partial number. With an
activation policy, the activation probe that ``mode=train`` runs before step 0 (``metered_probe``) is traced too,
in the same order (after ``attach``, before the policy is applied), under its own meter — except under
``dist=ddp|fsdp2``, where training skips it (``experiments.dist.checks.probe_skipped``) and so does the trace.

The report adds, beside the usual summary: peak bytes by category at each phase's peak, the modules retaining the
most forward bytes (what their forward left alive: saved activations and outputs), and a fits/does-not-fit
verdict per GPU size: the meters' allocation streams (the step's, the probe's) replayed through the CUDA caching
allocator's rules give the predicted reserved bytes, to which the GPU allowance lines (CUDA context, NCCL buffers,
side-stream pools; ``experiments.memory.gpu_allowance``) are added (``dryrun.reserve=flat``: the larger live peak plus
``dryrun.cuda_context_gib``, as before).
"""

from __future__ import annotations

import contextlib
import time
import traceback

from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from experiments import dryrun_device
from experiments.dist import checks as dist_checks
from experiments.dist import parallel as distributed
from experiments.config import RunConfig
from experiments.errors import UserError
from experiments.memory.gpu_allowance import allowance_of_trace, fsdp_unit_bytes, fsdp_unit_reduce_bytes, modeled_verdicts
from experiments.loop import autocast_context, check_lm_loss, cpu_rss_peak_bytes, train_step
from experiments.memory.meter import MemoryMeter
from experiments.models import count_params
from experiments.results import RunDir
from experiments.runs import build_summary, print_summary
from hmt_core.activations import apply_policy, probe
from hmt_core.activations.probe import PROBE_TOKENS, probe_batch
from hmt_core.method import NotTraceableError

GIB = 2**30


class AssumedScalars(TorchDispatchMode):
    """Answers a fake tensor's ``.item()``/``bool()`` (``aten._local_scalar_dense``) with 1 instead of failing, and
    records where it was asked (file:line of the first caller outside torch), for third-party code whose
    data-dependent control flow (e.g. apollo-torch's norm-growth limiter, ``max(ratio, γ)``) chooses between
    branches that allocate the same tensors. Every assumption is listed in the summary (``dryrun.assumed_scalars``);
    HMT's own code checks ``is_fake`` instead and must never appear there."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:  # fake mode answers constants itself; only unknowable values land here
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
        site = next((f"{Path(fr.filename).parent.name}/{Path(fr.filename).name}:{fr.lineno}"
                     for fr in reversed(traceback.extract_stack()[:-1])
                     if "/torch/" not in fr.filename and "/experiments/" not in fr.filename), "?")
        self.sites[site] = self.sites.get(site, 0) + 1
        dtype = args[0].dtype
        return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)


@contextlib.contextmanager
def unpacked_sequences():
    """Answer transformers' packed-sequence check on fake tensors as real tensors answer it: not packed.

    ``masking_utils.find_packed_sequence_indices`` cannot read fake position ids, so it assumes a batch may hold
    packed sequences and the model materializes a (batch, 1, seq, seq) causal mask, plus a copy that each attention
    layer saves for backward; on real tensors it returns ``None`` and SDPA uses ``is_causal`` (no mask). The
    harness never packs (it passes neither position ids nor an attention mask), so the dry run takes the real
    answer: the same ops run (the check included), only the answer is supplied. A no-op if transformers lacks it."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids):
        mask = original(position_ids)
        if mask is None or not is_fake(mask):
            return mask
        (mask[:, -1] == 0).all()  # the check real tensors run (its value would say "not packed")
        return None

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


class ModuleRetention:
    """Forward hooks recording, per module, the bytes its forward left alive (last traced step wins)."""

    def __init__(self, model: nn.Module, meter: MemoryMeter) -> None:
        self.meter = meter
        self.bytes: dict[str, int] = {}
        self._start: dict[str, int] = {}
        self._handles = []
        for name, module in model.named_modules():
            if name and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                self._handles.append(module.register_forward_pre_hook(self._pre(name)))
                self._handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str):
        def hook(module, args):
            self._start[name] = self.meter.current_bytes()
        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            if name in self._start:
                self.bytes[name] = self.meter.current_bytes() - self._start.pop(name)
        return hook

    def top(self, count: int) -> list[dict]:
        ranked = sorted(self.bytes.items(), key=lambda kv: (-kv[1], kv[0]))[:count]
        return [{"module": name, "forward_retained_bytes": int(b)} for name, b in ranked]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def verdicts(peak_bytes: int, sizes_gib: tuple[int, ...], reserve_gib: float) -> dict[str, dict]:
    out = {}
    for size in sizes_gib:
        headroom = size * GIB - reserve_gib * GIB - peak_bytes
        out[f"{size}GiB"] = {"fits": bool(headroom >= 0), "headroom_bytes": int(headroom)}
    return out


def gpu_verdicts(run: RunConfig, traced: dict, verdict_peak: int) -> dict:
    """Fits/does-not-fit per ``dryrun.gpu_sizes_gib``. ``dryrun.reserve=modeled``: the caching allocator's
    predicted reserved bytes (``experiments.memory.allocator_model``) plus the GPU allowance for ``dryrun.gpu_arch``
    (``experiments.memory.gpu_allowance``); ``flat``: the live peak plus ``dryrun.cuda_context_gib``. The predicted
    allocator peaks are reported either way."""
    d = run.dryrun
    allowance = allowance_of_trace(run, traced)
    modeled = modeled_verdicts(traced["alloc_events"], allowance, d.gpu_sizes_gib if d.reserve == "modeled" else (),
                               expandable_segments=d.expandable_segments)
    out = {"reserve": d.reserve, "gpu_arch": d.gpu_arch, "expandable_segments": d.expandable_segments,
           "predicted": modeled["predicted"], "allowance": allowance.to_dict()}
    if d.reserve == "flat":
        return {**out, "verdicts": verdicts(verdict_peak, d.gpu_sizes_gib, d.cuda_context_gib)}
    return {**out, "verdicts": modeled["verdicts"]}


def metered_probe(model: nn.Module, policy, ids: torch.Tensor, *, autocast, source: str,
                  max_tokens: int = PROBE_TOKENS) -> dict:
    """The activation probe (``hmt_core.activations.probe``) on ``probe_batch(ids, max_tokens)`` under its own
    meter, which tracks the weights (and quantization state) as the step's meter does, so its peak is comparable
    with the step's. ``autocast``: a callable returning the step's autocast context. Returns the probe's metrics,
    its peak bytes and its token count; under FakeTensorMode the metrics are NaN and the peak is the dry run's."""
    pids = probe_batch(ids, max_tokens)
    meter = MemoryMeter(source=source, device=pids.device)
    meter.track_model(model)
    meter.track([pids], "other")

    def loss_fn(m):
        with autocast():
            return m(input_ids=pids, labels=pids).loss

    with meter:
        metrics = probe(model, policy, loss_fn)
    return {"metrics": metrics, "peak_bytes": meter.report().peak_bytes, "tokens": int(pids.numel()),
            "events": meter.events}


def trace_steps(run: RunConfig, method, *, fake: bool = True) -> dict:
    """Build, prepare, attach and step under FakeTensorMode (``fake=False``: the same on real CPU tensors, which
    is how the fake figures are validated); returns the measured figures."""
    t = run.train
    assumed = AssumedScalars()
    target = torch.device(run.dryrun.device if fake else "cpu")  # whose dispatch decisions are traced
    with distributed.dryrun_context(run) as ctx, dryrun_device.dispatch_as(target), \
            FakeTensorMode() if fake else contextlib.nullcontext(), assumed if fake else contextlib.nullcontext(), \
            unpacked_sequences() if fake else contextlib.nullcontext():
        rows = t.batch_size // (ctx.world_size if ctx is not None else 1)  # this rank's share of the global batch
        torch.manual_seed(run.seed)
        model = distributed.build_sharded(run.model, method, ctx, vocab_size=None, device=torch.device("cpu"),
                                          values=not fake)  # fsdp2: on meta, fully_shard per layer + root
        model.train()
        params_total, params_trainable = count_params(model)
        meter = MemoryMeter(source="fake" if fake else "tracker", device=next(model.parameters()).device)
        meter.track_model(model)
        meter.watch_grads(model.parameters())
        try:
            method.attach(model, max_grad_norm=t.max_grad_norm or None)
        except ValueError as e:  # the method's settings do not fit this model (rank > dims, ...)
            raise UserError(str(e)) from None
        check_lm_loss(model, t)
        forward_model = distributed.wrap_for_forward(model, method, ctx, init_sync=not fake,  # ddp: DDP (or hmt's)
                                                     rebuild_buckets=False)
        vocab = model.get_input_embeddings().num_embeddings
        autocast = lambda: autocast_context(torch.device("cpu"), t.autocast)  # noqa: E731
        probed, act_handle = None, None
        if not run.activation.is_identity():  # as in mode=train: the probe (not under dist), then the policy
            if ctx is None:
                probed = metered_probe(model, run.activation, torch.randint(0, vocab, (rows, t.seq_len)),
                                       autocast=autocast, source=meter.source)
            act_handle = apply_policy(model, run.activation)
        retention = ModuleRetention(model, meter)
        for step in range(run.dryrun.steps):
            method.set_lr_scale(1.0)
            micro = [torch.randint(0, vocab, (rows, t.seq_len)) for _ in range(t.grad_accum)]
            with meter:
                train_step(forward_model, method, micro, meter=meter, autocast=autocast, fused_ce=t.fused_ce,
                           ce_chunk_tokens=t.ce_chunk_tokens)
        retention.remove()
        meter.remove_hooks()
        return {"report": meter.report(),
                "activation_saved_bytes": act_handle.saved_bytes() if act_handle else None,
                "probe_peak_bytes": probed["peak_bytes"] if probed else None,
                "probe_tokens": probed["tokens"] if probed else None,
                "alloc_events": [meter.events, probed["events"] if probed else []],
                "fsdp_unit_bytes": fsdp_unit_bytes(model), "fsdp_unit_reduce_bytes": fsdp_unit_reduce_bytes(model),
                "assumed_scalars": dict(assumed.sites), "params_total": params_total, "params_trainable": params_trainable,
                "top_modules": retention.top(run.dryrun.top_modules), "method_summary": method.summary(),
                "dist": None if ctx is None else {"mode": ctx.mode, "world_size": ctx.world_size,
                                                  "backend": ctx.backend, "rank": ctx.rank,
                                                  "batch_semantics": "global", "rank_batch_size": rows}}


def execute_dryrun(run: RunConfig, config_dict: dict, method, run_dir: RunDir, device: torch.device) -> dict:
    """Trace first, write after: a bad setting fails before anything in ``run_dir`` is touched."""
    dist_checks.check_launch(run, device)  # dist=ddp|fsdp2: dist.world_size, the method, the batch split
    start = time.perf_counter()
    try:
        traced = trace_steps(run, method)
    except NotTraceableError as e:
        summary = build_summary(run, run_dir.run_id, torch.device("cpu"), memory=None, val_loss=None,
                                dryrun={"traceable": False, "reason": str(e)})
        run_dir.start(config_dict)
        run_dir.finish(summary)
        run_dir.set_status("failed")
        raise UserError(str(e)) from None
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException as e:
        run_dir.start(config_dict)
        run_dir.fail("".join(traceback.format_exception(e)))
        raise
    wall = time.perf_counter() - start
    rep = traced["report"]
    t = run.train
    probe_peak = traced["probe_peak_bytes"] or 0
    verdict_peak = max(rep.peak_bytes, probe_peak)
    summary = build_summary(
        run, run_dir.run_id, torch.device("cpu"), params_total=traced["params_total"],
        params_trainable=traced["params_trainable"], steps=run.dryrun.steps,
        tokens=run.dryrun.steps * t.batch_size * t.seq_len * t.grad_accum, tokens_per_s=None, step_time_s=None,
        train_loss=None, val_loss=None, memory=rep.to_dict(), cpu_rss_peak_bytes=cpu_rss_peak_bytes(),
        host_device_bytes=rep.host_device_bytes, method_summary=traced["method_summary"],
        activation_summary=None if run.activation.is_identity() else {
            "policy": run.activation.to_dict(), "saved_bytes": traced["activation_saved_bytes"],
            "probe_peak_bytes": traced["probe_peak_bytes"], "probe_tokens": traced["probe_tokens"],
            **({"probe_skipped": dist_checks.probe_skipped(run.dist.mode)} if traced["dist"] else {})},
        **({"dist": traced["dist"]} if traced["dist"] else {}),
        dryrun={"traceable": True, "wall_s": wall, "seq_len": t.seq_len, "batch_size": t.batch_size,
                "top_modules": traced["top_modules"], "assumed_scalars": traced["assumed_scalars"],
                "cuda_context_gib": run.dryrun.cuda_context_gib, "verdict_peak_bytes": verdict_peak,
                "verdict_peak_from": "probe" if probe_peak > rep.peak_bytes else "step",
                **gpu_verdicts(run, traced, verdict_peak)},
    )
    summary["device"] = f"fake (target {run.dryrun.device})"
    run_dir.start(config_dict)
    run_dir.finish(summary)
    print_summary(summary, run_dir.path)
    print_dryrun(summary)
    return summary


def print_verdicts(d: dict) -> None:
    pred = d["predicted"]
    print(f"  caching allocator     : {pred['peak_allocated_bytes'] / GIB:.3f} GiB allocated, "
          f"{pred['peak_reserved_bytes'] / GIB:.3f} GiB reserved at peak ({pred['segments']} segments; predicted "
          f"max_memory_allocated/max_memory_reserved, cuBLAS workspaces included)")
    if d["reserve"] == "flat":
        print("  fits (with {:.1f} GiB reserve): ".format(d["cuda_context_gib"])
              + ", ".join(f"{k} {'yes' if v['fits'] else 'no'}" for k, v in d["verdicts"].items()))
        return
    print(f"  GPU allowance         : {d['allowance']['outside_bytes'] / GIB:.3f} GiB beside the allocator's "
          f"reserved bytes ({d['gpu_arch']}); per line:")
    for line in d["allowance"]["lines"]:
        where = "in reserved" if line["replayed"] else "added"
        print(f"    {line['bytes'] / 2**20:9.1f} MiB {where:<11} {line['name']} [{line['source']}]")
    print("  fits (reserved + allowance): "
          + ", ".join(f"{k} {'yes' if v['fits'] else 'no'}" for k, v in d["verdicts"].items()))


def print_dryrun(summary: dict) -> None:
    d, mem = summary["dryrun"], summary["memory"]
    print(f"  traced in             : {d['wall_s']:.1f} s (seq {d['seq_len']}, batch {d['batch_size']})")
    if summary.get("dist"):
        ds = summary["dist"]
        print(f"  dist                  : {ds['mode']}, rank {ds['rank']} of {ds['world_size']} ({ds['backend']} "
              f"process group), per-rank batch {ds['rank_batch_size']}; memory figures are this rank's")
    for phase, cats in mem["peak_by_phase_category_bytes"].items():
        print(f"  peak in {phase:<14}: {mem['peak_by_phase_bytes'][phase] / GIB:.3f} GiB  ("
              + ", ".join(f"{k} {v / GIB:.3f}" for k, v in cats.items() if v) + ")")
    act = summary.get("activation_summary") or {}
    if act.get("probe_peak_bytes") is not None:
        print(f"  activation probe peak : {act['probe_peak_bytes'] / GIB:.3f} GiB ({act['probe_tokens']} tokens, "
              f"before step 0; the verdict counts the larger of it and the step's peak)")
    elif act.get("probe_skipped"):
        print(f"  activation probe      : skipped ({act['probe_skipped'].split(':')[0]}: single-process)")
    print_verdicts(d)
    if d["assumed_scalars"]:
        print("  assumed scalar values : " + ", ".join(f"{k} x{v}" for k, v in d["assumed_scalars"].items())
              + " (data-dependent branches in third-party code, answered 1)")
    print("  top modules by retained forward bytes:")
    for row in d["top_modules"][:5]:
        print(f"    {row['module']:<40} {row['forward_retained_bytes'] / GIB:.3f} GiB")
