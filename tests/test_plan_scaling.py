"""Depth scaling of the dry-run meter's live bytes (``experiments.planner.scaling``), checked against full-depth traces.

What is proven: for Llama-, Qwen2- (GQA, q/k/v biases, untied head) and Gemma 2-shaped models (alternating
sliding/global layers, four norms per layer, tied head) the peak of every phase (forward, backward, optimizer)
and of the activation probe at L decoder layers equals, to the byte, the line through the 3- and 4-layer traces
of the same width — for AdamW with checkpointed layers and with everything kept — so a capacity search's live
bytes for AdamW at a card's depth are the full model's. Not covered, because it is not exact (measured, see
``experiments.planner.scaling``): HMT's Mode A (its state budget is spread over the layers) and GaLore's optimizer
phase on the Llama shape.
No tolerance: fake-tensor traces count exact integer bytes on both sides.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.planner import plan as planner
from experiments.planner.costs import STEP_PHASES, trace_sample
from experiments.planner.scaling import scaled_live

DEPTH = 5
BASE = ["train.seq_len=64", "train.batch_size=3", "dryrun.reserve=flat"]
METHODS = {"adamw-full-ckpt": ["method=adamw", "activation=full_ckpt"], "adamw-kept": ["method=adamw"]}
CONFIGS = {  # small widths of the cards' architectures (experiments/model_cards), one head_dim each
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
              "intermediate_size": 352, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
              "max_position_embeddings": 256, "tie_word_embeddings": False, "rope_theta": 1e6,
              "rms_norm_eps": 1e-6, "hidden_act": "silu", "num_hidden_layers": DEPTH},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 128,
               "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": True,
               "sliding_window": 32, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
               "num_hidden_layers": DEPTH},
}


def _model(name: str, tmp_path) -> list[str]:
    if name == "llama":
        return ["model=tiny", f"model.num_layers={DEPTH}"]
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    return [f"model.path={folder}"] + (["model.attn_implementation=eager"] if name == "gemma2" else [])


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_phase_peaks_at_depth_are_the_line_through_three_and_four_layers(arch, method, tmp_path):
    run = planner.run_config([*_model(arch, tmp_path), *BASE, *METHODS[method]])
    full = trace_sample(dataclasses.replace(run, mode="dryrun"))
    scaled = scaled_live(run)
    for key in (*STEP_PHASES, "probe", "peak"):
        assert scaled[key] == full[key], (arch, method, key, scaled[key], full[key],
                                          None if full[key] is None else scaled[key] - full[key])
