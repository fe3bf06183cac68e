"""A model directory's own tokenizer: Llama- and Mistral-shaped (``<s>`` prepended by the post-processor, EOS
``</s>``, no ``<|endoftext|>``), Qwen2 (EOS ``<|endoftext|>`` or ``<|im_end|>``) and GPT-2 tokenizers, built
locally from tiny ``tokenizers`` models (no network), encode the corpus as the model's tokenizer encodes text,
followed by its EOS; weights without a tokenizer, a tokenizer larger than the embedding and an unloadable one are
one-line errors; a config-only directory still gets a trained BPE; the harness's own saved models fine-tune."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_architectures import compose_run, config_dir
from test_runner import MICRO

from experiments.config import ModelConfig
from experiments.data.corpus import build_corpus, load_local_corpus, load_model_tokenizer, split_documents
from experiments.errors import UserError
from experiments.models import build_model
from experiments.train import model_tokenizer

WORDS = ("the council met in spring and spoke of roads harvests winter taxes every town must pay while rivers "
         "rose over the old bridge near the mill").split()
# family: (architecture, special tokens, bos, eos, post-processor prepends bos, tokenizer class)
FAMILIES = {
    "llama": ("llama", ["<unk>", "<s>", "</s>"], "<s>", "</s>", True, "LlamaTokenizerFast"),
    "mistral": ("mistral", ["<unk>", "<s>", "</s>"], "<s>", "</s>", True, "LlamaTokenizerFast"),
    "qwen2": ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>", False, None),
    "qwen2-chat": ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", False, None),
    "gpt2": ("gpt2", ["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>", False, None),
}


def text(i: int, n: int = 40) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n)) + f" {i}."


def tokenizer(family: str, vocab: int = 280):
    """A tiny trained tokenizer of ``family``'s shape, as ``transformers`` wraps it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    _, specials, bos, eos, prepends_bos, cls = FAMILIES[family]
    if prepends_bos:  # sentencepiece-style (Llama-2, Mistral): metaspace, unknown token, "<s> $A"
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    else:  # byte-level (GPT-2, Qwen2)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text(i) for i in range(50)], trainer=trainer)
    if prepends_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    wrapper = getattr(transformers, cls or "PreTrainedTokenizerFast")
    extra = {"unk_token": "<unk>"} if prepends_bos else {}
    return wrapper(tokenizer_object=tok, bos_token=bos, eos_token=eos, **extra)


def model_dir(root: Path, family: str, *, tokenizer_files: bool = True, weights: bool = False,
              vocab: int = 300) -> Path:
    """``config.json`` of the family's architecture (+ its tokenizer, + weights), in ``root/<family>``."""
    path = config_dir(root, FAMILIES[family][0], vocab=vocab)
    if family != path.name:
        path = path.rename(root / family)
    if weights:
        build_model(ModelConfig(path=str(path))).save_pretrained(str(path))
    if tokenizer_files:
        tokenizer(family).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokcorpus")
    rows = [json.dumps({"text": text(i, 30 + i % 17)}) for i in range(120)]
    (root / "docs.jsonl").write_text("\n".join(rows) + "\n")
    return root / "docs.jsonl"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_corpus_is_encoded_with_the_model_tokenizer(tmp_path, corpus, family):
    from transformers import AutoTokenizer

    path = model_dir(tmp_path, family)
    assert model_tokenizer(str(path)) == path
    built = build_corpus(path=str(corpus), text_field="text", val_fraction=0.1, vocab_size=300, seq_len=16,
                         batch_size=2, seed=0, cache_dir=str(tmp_path / "cache"), tokenizer_path=path)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)  # the oracle: transformers itself
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert eos == tok.convert_tokens_to_ids(FAMILIES[family][3])
    prepends = FAMILIES[family][4]
    if prepends:
        assert "<|endoftext|>" not in tok.get_vocab()
    assert (built.stats["tokenizer"], built.stats["tokenizer_path"], built.stats["eos_id"], built.stats["bos_id"]) == (
        "model", str(path), eos, bos if prepends else None)
    train, val = split_documents(load_local_corpus(str(corpus), "text"), 0.1)
    for docs, packed in ((train, built.train), (val, built.val)):
        expected = [i for d in docs for i in tok(d.text)["input_ids"] + [eos]]
        stream = np.asarray(packed.blocks).reshape(-1)
        assert stream.tolist() == expected[: len(stream)]
        ends = np.flatnonzero(stream == eos)  # EOS separates documents; with Llama/Mistral BOS opens the next
        assert len(ends) >= len(docs) - 1 and (not prepends or (stream[ends[:-1] + 1] == bos).all())
    assert built.tokenizer.decode(tok("spring roads")["input_ids"], skip_special_tokens=True).strip() == "spring roads"


def _recording_build_corpus(monkeypatch) -> dict:
    import experiments.train

    seen: dict = {}
    real = experiments.train.build_corpus

    def build(**kwargs):
        seen["corpus"] = real(**kwargs)
        return seen["corpus"]

    monkeypatch.setattr(experiments.train, "build_corpus", build)
    return seen


RUN = ("train.steps=2", "train.warmup_steps=1", "train.seq_len=32", "train.batch_size=2", "train.eval_batches=1",
       "method=adamw", "run_id=r")


@pytest.mark.parametrize("family, weights", [("llama", True), ("qwen2-chat", False)])
def test_runner_trains_with_the_model_tokenizer(tmp_path, corpus, monkeypatch, family, weights):
    path = model_dir(tmp_path, family, weights=weights)
    seen = _recording_build_corpus(monkeypatch)
    summary = compose_run(tmp_path / "results", f"model.path={path}", f"data.path={corpus}",
                          f"data.cache_dir={tmp_path / 'cache'}", *RUN)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    data = summary["data"]
    assert (data["tokenizer"], data["tokenizer_path"], data["eos_id"]) == ("model", str(path), tok.eos_token_id)
    assert summary["model_source"] == ("weights" if weights else "config") and math.isfinite(summary["val_loss"])
    stream = np.asarray(seen["corpus"].train.blocks).reshape(-1)
    ends = np.flatnonzero(stream == tok.eos_token_id)
    assert len(ends) > 10
    if family == "llama":
        assert data["bos_id"] == tok.bos_token_id == 1 and (stream[ends[:-1] + 1] == 1).all()
    else:
        assert data["bos_id"] is None and tok.eos_token == "<|im_end|>"


def test_weights_without_tokenizer_and_oversized_tokenizer_are_refused(tmp_path, corpus):
    data = (f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}")
    bare = model_dir(tmp_path, "qwen2", tokenizer_files=False, weights=True)
    message = f"model.path={bare} has weights but no tokenizer"
    with pytest.raises(UserError, match=message):
        model_tokenizer(str(bare))
    with pytest.raises(SystemExit, match=f"error: {message}.*a new tokenizer would not match the embeddings"):
        compose_run(tmp_path / "results", f"model.path={bare}", *data, *RUN)
    small = model_dir(tmp_path / "small", "gpt2", vocab=200)  # its 280-token tokenizer > 200 embedding rows
    with pytest.raises(SystemExit, match=rf"error: model.path={small}: its tokenizer \({small}\) has 280 tokens but "
                                         r"the model's embedding has 200 rows"):
        compose_run(tmp_path / "results", f"model.path={small}", *data, *RUN)
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())
    broken = model_dir(tmp_path / "broken", "llama")
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match=f"model.path={broken}: transformers cannot load its tokenizer"):
        load_model_tokenizer(broken)
    config_only = model_dir(tmp_path / "cfg", "llama", tokenizer_files=False)
    assert model_tokenizer(str(config_only)) is None and model_tokenizer(None) is None


def test_saved_model_fine_tunes_with_its_tokenizer(tmp_path, corpus, monkeypatch):
    seen = _recording_build_corpus(monkeypatch)
    common = (f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", *MICRO, "train.steps=2",
              "train.warmup_steps=1", "train.seq_len=32", "method=adamw")
    base = compose_run(tmp_path / "results", *common, "train.save_model=true", "run_id=base")
    saved = tmp_path / "results" / "base" / "model"
    assert base["data"]["tokenizer"] == "trained-bpe" and (saved / "tokenizer_config.json").exists()
    pretrain_stream = np.asarray(seen["corpus"].train.blocks).copy()
    tuned = compose_run(tmp_path / "results", *common, f"model.path={saved}", "run_id=ft")
    assert tuned["data"] | {"tokenizer": None, "tokenizer_path": None} == base["data"] | {
        "tokenizer": None, "tokenizer_path": None}
    assert tuned["data"]["tokenizer"] == "model" and tuned["model_source"] == "weights"
    assert np.array_equal(np.asarray(seen["corpus"].train.blocks), pretrain_stream)  # the same token ids
    (saved / "tokenizer_config.json").unlink()  # saved before tokenizer_config.json was written: EOS by name
    legacy = load_model_tokenizer(saved)
    assert (legacy.eos_id, legacy.bos_id, legacy.vocab_size) == (0, None, base["data"]["vocab_size"])
