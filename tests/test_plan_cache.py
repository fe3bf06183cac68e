"""The planner's committed cost table (``results/plan/costs/``) is current, and its keys are what changes a trace.

What is proven: every committed file's group key is the one this code computes from the overrides it was made
with (a changed default, model shape or ``METER_VERSION`` fails here), it holds every sample the planner needs
and the model's weights and FLOPs as computed now (so a fresh clone builds and traces nothing for it), and a sample of its entries re-traced now gives the same bytes (a meter or
step change that was not followed by regenerating the table fails here). Samples of choices added after a table
was made (``NEW_CHOICES``: the vocabulary settings and the layer-input codecs) may be missing — the planner traces
them on demand into the user's cache — but never stale: those present are re-traced like the rest. Each failure names the command that
regenerates the file. Keys carry no package versions and no model name; the entries of a planner killed mid-way
stay in the user's cache.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.planner import plan as planner
from experiments.planner import cache as plan_cache
from experiments.planner.costs import PHASES, Space, layer_variants, sample_plan, sample_run, trace_sample
from experiments.planner.model import region_flops, weight_stats
from experiments.planner.vocab import admissible, model_facts

FILES = plan_cache.committed_files()
# Re-traced per committed file: the reference at one layer and the first micro-batch, and one optimizer sample
# (Mode B, bf16 state, projected head) at one layer — the cheapest traces that cover the step's and an option's bytes.
RETRACED = ("ref", "opt:B:bf16:0:head")
# Sample names of choices added after the committed tables were made: missing from a table is allowed (traced on
# demand; ``python -m experiments.plan <overrides> --table`` adds them), a stale one is not.
NEW_CHOICES = ("vocab:", "act:layer_recompute:")
WEIGHTS = "weights:" + ",".join(sorted(Space().weight_dtypes))


def _regenerate(data: dict) -> str:
    return f"python -m experiments.plan {' '.join(data['overrides'])} --table"


def _needed(data: dict):
    run = planner.run_config(data["overrides"])
    space = Space()
    with layer_variants(run) as with_layers:
        vocab = admissible(space, run, model_facts(run, with_layers))
    return run, space, sample_plan(run, space, llama=True, vocab=vocab)


def test_the_committed_table_covers_the_named_models():
    assert {json.loads(f.read_text())["model"] for f in FILES} >= {"1b", "7b", "13b"}, FILES


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_committed_cost_table_is_current(path):
    data = json.loads(path.read_text())
    run, space, plan = _needed(data)
    key = plan_cache.group_key(run)
    assert data["group"] == key and path.name == plan_cache.file_name(data["model"], run, key), (
        f"{path.name}: made for group {data['group']}, this code computes {key} (a default, the meter version or "
        f"the key changed); regenerate it: {_regenerate(data)}")
    retrace, missing = [], []
    with layer_variants(run) as with_layers:
        for name, choice, changes, points in plan:
            for layers, batch in points:
                r = sample_run(run, with_layers, layers, batch, choice, changes, True)
                entry_key = plan_cache.entry_key(layers, batch, r.method, r.activation)
                if entry_key not in data["entries"] and name.startswith(NEW_CHOICES):
                    missing.append(name)  # traced on demand (the user's cache) until the table is extended
                    continue
                assert entry_key in data["entries"], f"{path.name} lacks {name} {entry_key}: {_regenerate(data)}"
                retraced = name in RETRACED or (name.startswith(NEW_CHOICES) and not any(
                    n.startswith(NEW_CHOICES) for n, *_ in retrace))  # one new-choice sample, when present
                if retraced and layers == 1 and not any(n == name for n, *_ in retrace):
                    retrace.append((name, r, entry_key))
        if missing:
            print(f"{path.name}: {len(missing)} samples of new choices missing (traced on demand; extend the "
                  f"table with {_regenerate(data)})")
        assert all(k in data["entries"] for k in (WEIGHTS, "flops")), f"{path.name}: {_regenerate(data)}"
        derived = {WEIGHTS: json.loads(json.dumps(weight_stats(run, space.weight_dtypes))), "flops": region_flops(run)}
        for k, value in derived.items():  # counted on fake tensors: exact
            assert data["entries"][k]["value"] == value, f"{path.name}: {k} is stale; regenerate it: {_regenerate(data)}"
        for name, r, entry_key in retrace:
            traced, stored = trace_sample(r), data["entries"][entry_key]
            # fake-tensor traces count exact bytes (no kernel runs), so equal to the byte on any CPU
            for field in (*PHASES, "peak", "params", "optimizer_state"):
                assert traced[field] == stored[field], (
                    f"{path.name} is stale: {name} L1 b{r.train.batch_size} {field} traced {traced[field]:,} B, "
                    f"table {stored[field]:,} B; regenerate it: {_regenerate(data)} (and bump "
                    "experiments.planner.cache.METER_VERSION)")


def test_group_key_has_no_package_versions_nor_model_name(monkeypatch):
    """A transformers/torch upgrade does not invalidate the table; a renamed model of the same shape shares it;
    a change of shape, sequence or meter version does not."""
    run = planner.run_config(["model=tiny", "train.seq_len=64"])
    key = plan_cache.group_key(run)
    import experiments.runs as runner

    monkeypatch.setattr(runner, "versions", lambda: {"torch": "0.0", "transformers": "0.0"})
    assert plan_cache.group_key(run) == key
    renamed = dataclasses.replace(run, model=dataclasses.replace(run.model, name="other"))
    assert plan_cache.group_key(renamed) == key
    deeper = dataclasses.replace(run, model=dataclasses.replace(run.model, num_layers=9))
    assert plan_cache.group_key(deeper) == key  # the depth is the entry's, not the group's
    wider = dataclasses.replace(run, model=dataclasses.replace(run.model, intermediate_size=700))
    longer = dataclasses.replace(run, train=dataclasses.replace(run.train, seq_len=128))
    assert len({key, plan_cache.group_key(wider), plan_cache.group_key(longer)}) == 3
    monkeypatch.setattr(plan_cache, "METER_VERSION", plan_cache.METER_VERSION + 1)
    assert plan_cache.group_key(run) != key


def test_group_key_holds_the_traced_device():
    """``dryrun.device=cuda`` traces CUDA's dispatch decisions (larger row chunks: other bytes), so it is another
    group; the default cpu is left out of the key (the committed tables keep their names)."""
    run = planner.run_config(["model=tiny", "train.seq_len=64"])
    cuda = planner.run_config(["model=tiny", "train.seq_len=64", "dryrun.device=cuda"])
    cpu = planner.run_config(["model=tiny", "train.seq_len=64", "dryrun.device=cpu"])
    assert plan_cache.group_key(cpu) == plan_cache.group_key(run) != plan_cache.group_key(cuda)
    assert "device" not in plan_cache.group_of(run)["run"]["dryrun"], plan_cache.group_of(run)["run"]["dryrun"]


def test_each_trace_is_cached_as_it_is_measured(tmp_path, monkeypatch):
    """A planner killed after its third trace keeps those three in the user's cache (written atomically after
    each trace), and the next run traces only the rest."""
    import experiments.planner.costs as costs

    run = planner.run_config(["model=tiny", "model.num_layers=2", "train.seq_len=32", "train.fused_ce=false"])
    space = Space(modes=("A",), state_dtypes=("bf16",), weight_dtypes=("bf16",), dense_8bit=(False,),
                  project_head=(False,), state_budgets=(0.25,), actions=("keep",), layer_recompute=(False,),
                  max_batch_size=4)
    real, calls = costs.trace_sample, []

    def killed_after_three(r, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(r)
        return real(r, **kw)

    monkeypatch.setattr(costs, "trace_sample", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        costs.measure(run, space, llama=True, cache_dir=tmp_path, log=lambda _: None)
    (path,) = tmp_path.glob("*.json")
    assert len(json.loads(path.read_text())["entries"]) == 3
    monkeypatch.setattr(costs, "trace_sample", real)
    record = costs.measure(run, space, llama=True, cache_dir=tmp_path, log=lambda _: None)
    total = sum(len(points) for *_, points in sample_plan(run, space, True))
    assert (record["cached"], record["traces"]) == (3, total - 3), (record["cached"], record["traces"], total)


def test_samples_traced_in_worker_processes_are_the_bytes_traced_here(tmp_path, monkeypatch):
    """The missing traces handed to worker processes (``experiments.planner.tracing``; forced here by a zero
    threshold) give the same record, byte for byte, as tracing them all in this process: each trace is
    deterministic and counts exact bytes on fake tensors."""
    import experiments.planner.costs as costs
    import experiments.planner.tracing as tracing

    run = planner.run_config(["model=tiny", "model.num_layers=2", "train.seq_len=32", "train.fused_ce=false"])
    space = Space(modes=("A",), state_dtypes=("bf16",), weight_dtypes=("bf16",), dense_8bit=(False,),
                  project_head=(False,), state_budgets=(0.25,), actions=("keep",), layer_recompute=(False,),
                  max_batch_size=2)
    here = costs.measure(run, space, llama=True, cache_dir=tmp_path / "here", log=lambda _: None, workers=1)
    monkeypatch.setattr(tracing, "PARALLEL_MIN_S", 0.0)
    spawned = []
    real_pooled = tracing._pooled
    monkeypatch.setattr(tracing, "_pooled", lambda points, *a: spawned.extend(points) or real_pooled(points, *a))
    pooled = costs.measure(run, space, llama=True, cache_dir=tmp_path / "pool", log=lambda _: None, workers=2)
    assert len(spawned) == pooled["traces"] - 1 >= 2, (len(spawned), pooled["traces"])  # all but the first
    assert pooled["traces"] == here["traces"] and pooled["samples"] == here["samples"], (
        {n: {p: v["peak"] for p, v in s.items()} for n, s in here["samples"].items()},
        {n: {p: v["peak"] for p, v in s.items()} for n, s in pooled["samples"].items()})
    (a,), (b,) = (tmp_path / "here").glob("*.json"), (tmp_path / "pool").glob("*.json")
    assert json.loads(a.read_text())["entries"] == json.loads(b.read_text())["entries"]
