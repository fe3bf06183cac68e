"""Any Hugging Face architecture from its ``config.json``: Llama, Mistral, Qwen2 and GPT-2 (``Conv1D`` layers)
directories holding only a config train through the runner and trace in a dry run; bad configs and target
patterns that match nothing are one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments import methods
from experiments.config import ModelConfig
from experiments.errors import UserError
from experiments.models import build_model, load_hf_config, max_positions, model_source, model_vocab_size
from experiments.results import read_metrics
from experiments.execute import main_with_config
from hmt_core.hmt import projected_weight_names

CONF = str(Path(__file__).resolve().parent.parent / "experiments" / "conf")
ARCHS = ("llama", "mistral", "qwen2", "gpt2")
# 2-D weights the default target_patterns (attn, mlp) select per layer
PROJECTED_PER_LAYER = {"llama": 7, "mistral": 7, "qwen2": 7, "gpt2": 4}


def hf_config(arch: str, *, hidden: int = 64, layers: int = 2, vocab: int = 300, positions: int = 128):
    """A transformers config of ``arch`` at the given shape (4 heads; 2 KV heads where the architecture has GQA)."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=positions, vocab_size=vocab,
                          bos_token_id=0, eos_token_id=0)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    extra = {"sliding_window": positions} if arch == "mistral" else {}
    return cls(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=4 if arch == "llama" else 2, intermediate_size=hidden * 11 // 4,
               vocab_size=vocab, max_position_embeddings=positions, tie_word_embeddings=False,
               bos_token_id=0, eos_token_id=0, **extra)


def config_dir(root: Path, arch: str, **shape) -> Path:
    """A model directory holding only ``config.json``."""
    path = root / arch
    path.mkdir(parents=True, exist_ok=True)
    hf_config(arch, **shape).to_json_file(str(path / "config.json"))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(a small local text corpus, a tokenizer cache shared by the module's runs)."""
    root = tmp_path_factory.mktemp("corpus")
    words = "the council met in spring and spoke of roads harvests winter and the taxes every town must pay".split()
    paragraphs = [" ".join(words[i % len(words):] + words[:i % len(words)]) + f" Chapter {i}." for i in range(600)]
    (root / "book.txt").write_text("\n\n".join(paragraphs))
    return root / "book.txt", root / "cache"


def compose_run(results: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("run", overrides=[f"results_dir={results}", "train.progress=false", "train.log_every=1",
                                        *overrides])
    return main_with_config(cfg)


def _recording_build_model(monkeypatch) -> dict:
    """Wrap the ``build_model`` the runner calls (through ``experiments.dist.parallel.build_sharded``) to keep the built model and a copy of its initial weights."""
    import experiments.dist.parallel

    seen: dict = {}
    real = experiments.dist.parallel.build_model

    def build(*args, **kwargs):
        model = real(*args, **kwargs)
        seen["model"] = model
        seen["initial"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return model

    monkeypatch.setattr(experiments.dist.parallel, "build_model", build)
    return seen


@pytest.mark.parametrize("method", ["hmt", "adamw"])
@pytest.mark.parametrize("arch", ARCHS)
def test_config_only_directory_trains(tmp_path, corpus, monkeypatch, arch, method):
    text, cache = corpus
    path = config_dir(tmp_path, arch)
    seen = _recording_build_model(monkeypatch)
    summary = compose_run(tmp_path / "results", f"model.path={path}", f"method={method}", f"data.path={text}",
                          f"data.cache_dir={cache}", "train.steps=3", "train.warmup_steps=1", "train.seq_len=32",
                          "train.batch_size=2", "train.eval_batches=1", "run_id=r")
    model = seen["model"]
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                    "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}[arch]
    assert model.get_input_embeddings().num_embeddings == 300  # the config's vocab, not the tokenizer's
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and model.config.use_cache is False
    losses = [row["loss/train"] for row in read_metrics(tmp_path / "results" / "r")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert math.isfinite(summary["val_loss"])
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), seen["initial"][n])}
    targets = projected_weight_names(model, ("attn", "mlp"))
    assert len(targets) == 2 * PROJECTED_PER_LAYER[arch]
    assert targets <= changed and model.get_input_embeddings().weight.requires_grad
    if method == "hmt":
        params = dict(model.named_parameters())
        assert summary["method_summary"]["projected_params"] == sum(params[n].numel() for n in targets) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_mid_size_dry_run_counts_bf16_weights(tmp_path, arch):
    path = config_dir(tmp_path, arch, hidden=512, layers=2, vocab=32000, positions=2048)
    summary = compose_run(tmp_path / "results", "mode=dryrun", f"model.path={path}", "method=hmt",
                          "train.seq_len=128", "train.batch_size=1", "run_id=d")
    n = summary["params_total"]
    assert summary["memory"]["source"] == "fake"
    assert summary["memory"]["peak_by_category_bytes"]["params"] == 2 * n
    expected = build_model(ModelConfig(path=str(path)), device="meta")
    assert n == sum(p.numel() for p in expected.parameters())
    weights = dict(expected.named_parameters())
    targets = projected_weight_names(expected, ("attn", "mlp"))
    assert summary["method_summary"]["projected_params"] == sum(weights[t].numel() for t in targets)


def test_gpt2_conv1d_weights_are_projected_and_qlora_finds_its_targets(tmp_path, corpus):
    from transformers.pytorch_utils import Conv1D

    from baselines.galore import split_params
    from baselines.qlora import DEFAULT_TARGETS, resolve_target_modules

    model = build_model(ModelConfig(path=str(config_dir(tmp_path, "gpt2"))))
    conv = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Conv1D)}
    assert len(conv) == 8 and projected_weight_names(model, ("attn", "mlp")) == conv
    regular, lowrank = split_params(model, ("attn", "mlp"), rank=4)
    assert len(lowrank) == 8 and len(regular) + len(lowrank) == len(list(model.parameters()))
    assert resolve_target_modules(model, DEFAULT_TARGETS) == ("c_attn",)  # peft's default for gpt2
    assert resolve_target_modules(model, ("c_fc", "q_proj")) == ("c_fc",)
    with pytest.raises(ValueError, match=r"target_modules=\['q_proj'\] match no Linear/Conv1D module of gpt2; "
                                        r"names look like: c_attn, c_proj, c_fc"):
        resolve_target_modules(model, ("q_proj",))
    text, cache = corpus
    summary = compose_run(tmp_path / "results", f"model.path={tmp_path / 'gpt2'}", "method=qlora",
                          "method.target_modules=[c_attn,c_fc]", f"data.path={text}", f"data.cache_dir={cache}",
                          "train.steps=2", "train.warmup_steps=1", "train.seq_len=32", "train.batch_size=2",
                          "train.eval_batches=1")
    assert summary["method_summary"]["quantized_linear_layers"] == 4 and math.isfinite(summary["train_loss"])


@pytest.mark.parametrize("name", ["hmt", "galore", "apollo"])
def test_target_patterns_matching_nothing_is_an_error(tmp_path, name):
    model = build_model(ModelConfig(path=str(config_dir(tmp_path, "gpt2"))))
    method = methods.make_method(methods.make_config({"name": name, "target_patterns": ["nomatch"]}))
    with pytest.raises(ValueError, match=r"method.target_patterns=\['nomatch'\] match no 2-D Linear/Conv1D weight of "
                                        r"gpt2; names look like: transformer.h.N.attn.c_attn"):
        method.attach(model, max_grad_norm=None)


def test_target_patterns_error_through_the_runner_writes_nothing(tmp_path):
    path = config_dir(tmp_path, "llama")
    with pytest.raises(SystemExit, match=r"error: method.target_patterns=\['nomatch'\] match no 2-D Linear/Conv1D "
                                         r"weight of llama; names look like: model.layers.N.self_attn.q_proj"):
        compose_run(tmp_path / "results", "mode=dryrun", f"model.path={path}", "method=hmt",
                    "method.target_patterns=[nomatch]", "train.seq_len=32", "train.batch_size=1")
    assert not any((tmp_path / "results").iterdir())


@pytest.mark.parametrize("text, message", [
    ('{"model_type": "llama",\n  "hidden_size": 64,,\n}', r"is not valid JSON: .* at line 2, column 21"),
    ('["llama"]', "must hold a JSON object"),
    ('{"hidden_size": 64}', 'has no "model_type"'),
    ('{"model_type": "nosuch"}', "model_type='nosuch' is not an architecture transformers"),
    ('{"model_type": "t5"}', "model_type='t5' has no causal-LM head"),
])
def test_bad_config_json_is_a_user_error_naming_the_file(tmp_path, text, message):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(text)
    with pytest.raises(UserError, match=message) as err:
        load_hf_config(tmp_path / "m")
    assert str(tmp_path / "m" / "config.json") in str(err.value)
    with pytest.raises(SystemExit, match=f"error: {tmp_path}/m/config.json"):
        compose_run(tmp_path / "results", f"model.path={tmp_path / 'm'}", "train.steps=1")
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_vocab_positions_and_source_come_from_the_config(tmp_path):
    llama2 = ModelConfig(path=str(config_dir(tmp_path, "llama", vocab=32000, positions=4096)))
    gpt2 = ModelConfig(path=str(config_dir(tmp_path, "gpt2", positions=1024)))
    assert (model_vocab_size(llama2), max_positions(llama2), model_source(llama2)) == (32000, 4096, "config")
    assert (model_vocab_size(gpt2), max_positions(gpt2)) == (300, 1024)
    assert (model_vocab_size(ModelConfig()), max_positions(ModelConfig())) == (4096, 4096)
    with pytest.raises(UserError, match=r"the tokenizer has 301 tokens but .*gpt2/config.json has vocab_size=300"):
        build_model(gpt2, vocab_size=301)


def test_directory_with_weights_is_loaded_not_reinitialized(tmp_path):
    path = config_dir(tmp_path, "qwen2")
    torch.manual_seed(0)
    saved = build_model(ModelConfig(path=str(path)))
    saved.save_pretrained(str(path))
    cfg = ModelConfig(path=str(path))
    assert model_source(cfg) == "weights" and model_source(cfg, shapes_only=True) == "config"
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert model_source(cfg) == "config"  # a dry run needs shapes only: weights are never read
    loaded = build_model(cfg, vocab_size=256)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2"
    for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
