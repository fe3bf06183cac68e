"""Corpus loading, document split, tokenizer cache and deterministic packed batches."""

import json

import numpy as np
import pytest
import torch

from experiments.data import (Document, PackedTokens, build_corpus, load_builtin_corpus, load_local_corpus,
                              split_documents)
from experiments.errors import UserError


def test_builtin_corpus_split_is_by_document_and_deterministic():
    docs = load_builtin_corpus()
    assert len(docs) == 249 and all(d.text for d in docs)
    train, val = split_documents(docs, 0.05)
    train2, val2 = split_documents(list(reversed(docs)), 0.05)
    assert {d.doc_id for d in val} == {d.doc_id for d in val2}  # independent of order
    assert not {d.doc_id for d in train} & {d.doc_id for d in val}
    assert 0 < len(val) < 0.15 * len(docs) and len(train) + len(val) == len(docs)
    del train2


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.int32)
    a, b = PackedTokens(tokens, 10, 4, seed=3), PackedTokens(tokens, 10, 4, seed=3)
    assert torch.equal(a.batch(7), b.batch(7)) and torch.equal(a.batch(30), b.batch(30))  # step 30 is epoch 2
    assert not torch.equal(a.batch(7), PackedTokens(tokens, 10, 4, seed=4).batch(7))
    epoch = torch.cat([a.batch(s) for s in range(25)])  # 100 blocks, 25 steps of 4: each block once per epoch
    assert sorted(epoch[:, 0].tolist()) == list(range(0, 1000, 10))


def test_local_corpus_txt_jsonl_parquet(tmp_path):
    import pandas as pd

    (tmp_path / "a.txt").write_text("hello world\nsecond line")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(3)))
    pd.DataFrame({"text": ["p0", "p1"]}).to_parquet(tmp_path / "c.parquet")
    docs = load_local_corpus(str(tmp_path), "text")
    texts = sorted(d.text for d in docs)
    assert texts == sorted(["hello world\nsecond line", "row 0", "row 1", "row 2", "p0", "p1"])
    with pytest.raises(ValueError, match="data.text_field='body'"):
        load_local_corpus(str(tmp_path / "b.jsonl"), "body")
    with pytest.raises(UserError, match="no .txt/.jsonl"):
        (tmp_path / "empty").mkdir()
        load_local_corpus(str(tmp_path / "empty"), "text")


def test_build_corpus_caches_tokenizer_and_round_trips_text(tmp_path):
    kwargs = dict(path=None, text_field="text", val_fraction=0.05, vocab_size=512, seq_len=64, batch_size=2, seed=0,
                  cache_dir=str(tmp_path), min_year=1900, max_year=1960)
    corpus = build_corpus(**kwargs)
    assert corpus.vocab_size == 512 and corpus.stats["train_docs"] > corpus.stats["val_docs"] > 0
    files = sorted(p.name for p in tmp_path.iterdir())
    again = build_corpus(**kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # second build reads the cache
    assert torch.equal(corpus.train.batch(3), again.train.batch(3))
    text = "The Congress shall"
    assert corpus.tokenizer.decode(corpus.tokenizer.encode(text).ids) == text
    with pytest.raises(ValueError, match="no documents with year"):
        build_corpus(**{**kwargs, "min_year": 3000, "max_year": 3001})


def test_split_needs_two_documents_and_always_fills_both_sides():
    with pytest.raises(UserError, match="need at least 2"):
        split_documents([Document("only", "x")], 0.05)
    docs = [Document(f"d{i}", "x") for i in range(3)]
    for fraction in (1e-9, 1 - 1e-9):  # hashing puts everything on one side: one document moves over
        train, val = split_documents(docs, fraction)
        assert len(train) + len(val) == 3 and train and val
        _, val_reversed = split_documents(list(reversed(docs)), fraction)
        assert {d.doc_id for d in val} == {d.doc_id for d in val_reversed}  # still independent of order
