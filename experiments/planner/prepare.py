"""What the planner measures once per (model, settings) before it solves: the choice space, the weights, the traced
costs (``experiments.planner.costs`` through the cost table, ``experiments.planner.cache``), the FLOPs and the
calibration. ``experiments.planner.plan`` solves and verifies on it; ``experiments.planner.oom`` re-solves on it
after an out-of-memory error (so neither reaches the runner through the other)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from experiments.errors import UserError
from experiments.memory.gpu_allowance import reserve_bytes, reserve_label
from experiments.models import TORCH_DTYPES
from experiments.planner.cache import TABLE_DIR, USER_DIR, Table
from experiments.planner.costs import GIB, Space, derive, layer_variants, lin, measure, target_layers
from experiments.planner.model import calibrate, int8_table_bytes, param_bytes, region_flops, weight_stats
from experiments.planner.report import model_label
from experiments.planner.tracing import default_workers
from experiments.planner.streaming import Streaming, device_delta, streaming_model
from experiments.planner.vocab import admissible, first_refusal, model_facts

SPACE_KEYS = ("modes", "state_budgets", "state_dtypes", "weight_dtypes", "dense_8bit", "project_head", "actions",
              "layer_recompute", "embedding_dtypes", "embedding_updates", "head_updates", "layer_inputs",
              "weight_offloads", "max_batch_size", "mode_b_head")


def space_from(planner: dict) -> Space:
    values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in planner.items() if k in SPACE_KEYS}
    try:
        return Space(**values)
    except (TypeError, ValueError) as e:
        raise UserError(f"planner choice space: {e}") from None


def load_calibration(planner: dict, run) -> dict:
    path = planner.get("calibration")
    if path is None:
        return {**calibrate("cpu", TORCH_DTYPES[run.model.dtype]), "source": "measured now (cpu)"}
    try:
        return {**json.loads(Path(path).read_text()), "source": str(path)}
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"calibration={path}: cannot read a calibration file ({e})") from None


def workers_from(planner: dict) -> int:
    """``workers=``: processes the missing cost traces may use (default: this process's CPUs, at most 8)."""
    workers = planner.get("workers")
    if workers is None:
        return default_workers()
    if workers < 1:
        raise UserError(f"workers={workers}: the processes tracing missing costs, at least 1")
    return workers


def floor(run, space: Space, table: Table, stats: dict, lowest: str):
    """The fewest GiB the model's weights can take (its projected weights in ``lowest``; with INT8 embedding and
    LM head when the space offers them and the model takes them: ``experiments.planner.vocab.int8_table_bytes``),
    what they are, and a function caching the INT8 tables' bytes (called once the budget holds them)."""
    layers = target_layers(run)
    weights, label = param_bytes(stats, layers, lowest) / GIB, f"{lowest} projected weights"
    if "host" in space.weight_offloads:  # the streamed layers leave the device but the ones at work
        patterns = (run.method.attn_pattern, run.method.mlp_pattern)
        delta = device_delta(stats, layers, patterns, lowest)
        streamed = param_bytes(stats, layers, lowest) / GIB + max(delta.values())
        if streamed < weights:
            weights, label = streamed, f"{lowest} projected weights streamed from the host (2 layers on the device)"
    if "int8" not in space.embedding_dtypes:
        return weights, label, lambda: None
    key = f"weights:vocab-int8:{lowest}"
    hit = table.get(key)
    both = hit["value"] if hit else int8_table_bytes(run, lowest)
    if both is not None and lin(*both, layers) / GIB < weights:
        weights, label = lin(*both, layers) / GIB, f"{label}, INT8 embedding and LM head"
    return weights, label, lambda: table.memo(key, lambda: both)


def vocab_choices(run, space: Space, table: Table) -> dict:
    """The vocabulary settings of ``space`` the app accepts for ``run`` (``experiments.planner.vocab.admissible``;
    the model's facts from the table or a 1-layer model on fake tensors); none at all is refused in one line."""
    def facts():
        with layer_variants(run) as with_layers:
            return model_facts(run, with_layers)

    known = table.memo("model_facts", facts)
    vocab = admissible(space, run, known)
    if not any(vocab.values()):
        keys = ", ".join(f"{k}={list(getattr(space, k))}" for k in ("embedding_dtypes", "embedding_updates",
                                                                      "head_updates"))
        raise UserError(f"{keys}: {model_label(run)} admits none of these vocabulary settings "
                        f"({first_refusal(space, run, known)}); list bf16 and dense too")
    return vocab


@dataclass
class Prepared:
    """Everything measured once per (model, settings): weights, traced costs, FLOPs, calibration."""

    run: object
    space: Space
    layers: int
    stats: dict
    llama: bool
    record: dict
    costs: object
    flops: dict
    cal: dict
    weights_gib: float
    lowest: str  # what the leanest weights are (e.g. "int8 projected weights")
    table: Table | None = None  # where more cost samples are read and cached (``experiments.planner.extend``)
    workers: int = 1  # processes missing cost traces may use
    streaming: Streaming | None = None  # what a streamed option changes (``experiments.planner.streaming``)

    @property
    def verify_dir(self) -> Path:
        return Path(self.run.results_dir).expanduser() / "plan_verify"

    @property
    def floor_gib(self) -> float:
        return self.weights_gib + reserve_bytes(self.run) / GIB


def prepare(run, planner: dict, *, log=print, table_type=None) -> Prepared:
    """``table_type``: the ``experiments.planner.cache.Table`` class to read and trace costs through (a subclass
    may bound the time spent tracing: ``experiments.planner.oom``)."""
    space = space_from(planner)
    workers = workers_from(planner)  # a bad value refused before anything is traced
    layers = target_layers(run)
    # --table: the committed file, extended by what it lacks (its entries are current by their group key, which
    # holds METER_VERSION); refresh_costs=true: traced again from scratch
    table = (table_type or Table)(run, model_label(run), TABLE_DIR if planner.get("table") else
                                  Path(run.results_dir).expanduser() / USER_DIR, planner.get("_overrides"))
    if planner.get("refresh_costs"):
        table.clear()
    wkey = "weights:" + ",".join(sorted(space.weight_dtypes))
    hit = table.get(wkey)
    stats = hit["value"] if hit else json.loads(json.dumps(weight_stats(run, space.weight_dtypes)))
    lowest = min(space.weight_dtypes, key=lambda w: param_bytes(stats, layers, w))
    weights, label, cache = floor(run, space, table, stats, lowest)
    budget = planner.get("budget_gib")
    ctx = reserve_bytes(run) / GIB
    if budget is not None and budget < weights + ctx:  # before any trace
        raise UserError(f"budget_gib={budget:g} is below the floor of {model_label(run)}: its weights alone take "
                        f"{weights:.2f} GiB ({label}) + {reserve_label(run)} {ctx:.2f} = {weights + ctx:.2f} GiB")
    table.memo(wkey, lambda: stats)  # cached once the budget holds the weights (a refused budget writes nothing)
    cache()
    llama = stats["L1"]["llama"]
    vocab = vocab_choices(run, space, table)
    record = measure(run, space, llama=llama, table=table, log=log, workers=workers, vocab=vocab)
    flops = table.memo("flops", lambda: region_flops(run)) if llama else {}
    cal = load_calibration(planner, run)
    try:
        streaming = streaming_model(run, planner, cal, stats, layers)
    except ValueError as err:
        raise UserError(str(err)) from None
    return Prepared(run, space, layers, stats, llama, record, derive(record, layers), flops, cal, weights, label,
                    table, workers, streaming)
