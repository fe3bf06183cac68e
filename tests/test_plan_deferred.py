"""The planner's bound on HMT Mode A's optimizer phase past the traced depths (``experiments.planner.deferred``).

What is proven: on a small Llama shape whose LM head is large against its layers (as Llama-3.2-1B/3B's are), the
optimizer-phase peak traced at full depth (6 layers) is ABOVE the line through the 1- and 2-layer traces when clipping
defers the low-rank updates (the old prediction, which this test fails on), and at most the planner's bound;
without clipping (nothing deferred) the bound adds nothing and the line is the full trace.
No tolerance: fake-tensor traces count exact integer bytes on both sides, and the bound is an upper bound.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.planner import plan as planner
from experiments.planner.costs import GIB, layer_variants, lin, trace_sample
from experiments.planner.deferred import deferred_excess_gib, deferred_settings
from experiments.planner.model import weight_stats

DEPTH = 6
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 384,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16384, "max_position_embeddings": 256,
         "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "hidden_act": "silu", "num_hidden_layers": DEPTH}
BASE = ["train.seq_len=64", "train.batch_size=1", "dryrun.reserve=flat", "method.mode=A", "method.dense_8bit=true",
        "method.state_budget=null", "method.rank=64"]


def _traces(tmp_path, *extra: str):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    run = planner.run_config([f"model.path={tmp_path}", *BASE, *extra])
    with layer_variants(run) as with_layers:
        return run, {n: trace_sample(dataclasses.replace(with_layers(n), mode="dryrun")) for n in (1, 2, DEPTH)}


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_optimizer_phase_at_depth_is_within_the_bound(clip, tmp_path):
    run, s = _traces(tmp_path, f"train.max_grad_norm={clip}")
    record = {"deferred": deferred_settings(run), "segments": [(1, 1, 2)],
              "samples": {"A": {"L1b1": s[1], "L2b1": s[2]}}}
    line = lin(s[1]["optimizer"], s[2]["optimizer"], DEPTH)
    bound = line + deferred_excess_gib(record, weight_stats(run), "A", DEPTH) * GIB
    traced = s[DEPTH]["optimizer"]
    numbers = f"clip {clip}: line {line}, bound {bound:.0f}, traced {traced} (bytes)"
    assert traced <= bound, numbers
    if clip:
        assert line < traced, numbers  # the deferred update, hidden at 1-2 layers: the old prediction is short
    else:
        assert bound == line == traced, numbers  # nothing deferred: the line is exact and nothing is added
