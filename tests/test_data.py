"""Corpus loading (streamed), document split, tokenizer and token-file caches, and deterministic packed batches
read from memory-mapped token files."""

import json
import random
import re

import numpy as np
import pytest
import torch

from experiments.data.corpus import (Document, PackedTokens, build_corpus, load_builtin_corpus, load_local_corpus,
                              split_documents)
from experiments.errors import UserError
from experiments.data.local_corpus import iter_documents, split_long_text


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
    assert corpus.tokenizer.decode(corpus.tokenizer.encode(text)) == text
    assert corpus.stats["tokenizer"] == "trained-bpe" and corpus.stats["bos_id"] is None
    assert isinstance(corpus.train.blocks, np.memmap) and corpus.train.blocks.dtype == np.uint16
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


class InMemoryPackedTokens:
    """The reference: packed batches as they were computed before token files were memory-mapped (the whole
    stream as one int64 tensor)."""

    def __init__(self, tokens, seq_len, batch_size, seed):
        n = len(tokens) // seq_len
        self.blocks = torch.from_numpy(np.asarray(tokens[: n * seq_len]).astype(np.int64)).view(n, seq_len)
        self.batch_size, self.seed = batch_size, seed

    def batch(self, step):
        idx = []
        for pos in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, offset = divmod(pos, len(self.blocks))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            idx.append(int(torch.randperm(len(self.blocks), generator=g)[offset]))
        return self.blocks[idx]


def test_memmapped_batches_equal_in_memory_batches(tmp_path):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 50_000, size=10_007).astype(np.uint16)
    stream.tofile(tmp_path / "t.bin")
    mapped = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    a, ref = PackedTokens(mapped, 32, 3, seed=5), InMemoryPackedTokens(stream.astype(np.int32), 32, 3, seed=5)
    assert isinstance(a.blocks, np.memmap) and np.shares_memory(a.blocks, mapped)  # a view, not a copy
    for step in (*range(0, 120), 500, 1041):  # 312 blocks: steps past 104 are later epochs
        got = a.batch(step)
        assert got.dtype == torch.int64 and torch.equal(got, ref.batch(step)), step
    assert torch.equal(torch.cat(a.fixed_batches(4)), ref.blocks[:12])


def test_token_cache_follows_the_corpus_and_the_split(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"{i:02d}.txt").write_text(f"document {i} " + "words of the council and the town " * 20)
    kw = dict(path=str(corpus), text_field="text", val_fraction=0.1, vocab_size=300, seq_len=16, batch_size=2, seed=0,
              cache_dir=str(tmp_path / "cache"))

    def token_files():
        return {p.name for p in (tmp_path / "cache").glob("tokens-*.bin")}

    first = build_corpus(**kw)
    files = token_files()
    assert len(files) == 2 and build_corpus(**kw).stats == first.stats and token_files() == files  # a cache hit
    (corpus / "07.txt").write_text("document seven, rewritten " * 30)
    changed = build_corpus(**kw)
    assert len(token_files()) == 4 and changed.stats["train_tokens"] != first.stats["train_tokens"]
    build_corpus(**{**kw, "val_fraction": 0.5})  # another split: other token files
    assert len(token_files()) == 6 and not list((tmp_path / "cache").glob("*.tmp*"))


def test_tokenizer_is_trained_on_a_capped_sample(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text(" ".join(f"word{i}" for i in range(3000)))
    (tmp_path / "c" / "b.txt").write_text(" ".join(f"other{i}" for i in range(3000)))
    kw = dict(path=str(tmp_path / "c"), text_field="text", val_fraction=0.05, vocab_size=2000, seq_len=8, batch_size=2,
              seed=0, cache_dir=str(tmp_path / "cache"), chunk_chars=2000)
    full, capped = build_corpus(**kw), build_corpus(**kw, tokenizer_sample_chars=500)
    assert capped.vocab_size < full.vocab_size <= 2000  # fewer distinct pairs to merge in 500 characters
    assert capped.stats["train_tokens"] > full.stats["train_tokens"]


def regex_split(text: str, max_chars: int) -> list[str]:
    """The reference for ``split_long_text``: paragraphs by ``re.split(r"\\n\\s*\\n")``, packed greedily."""
    if max_chars <= 0 or len(text) <= max_chars:
        return [text]
    units = []
    for paragraph in re.split(r"\n\s*\n", text):
        if len(paragraph) <= max_chars:
            units.append(paragraph)
            continue
        for line in paragraph.split("\n"):
            units += [line[i : i + max_chars] for i in range(0, max(len(line), 1), max_chars)]
    pieces, current = [], ""
    for unit in units:
        if not unit.strip():
            continue
        candidate = f"{current}\n\n{unit}" if current else unit
        if len(candidate) <= max_chars:
            current = candidate
        else:
            pieces.append(current)
            current = unit
    return (pieces + [current] if current else pieces) or [text]


def test_streamed_pieces_equal_the_paragraph_split(tmp_path):
    rng = random.Random(0)
    parts = ["a", "word ", "lorem ipsum ", " ", "\n", "\n", "\n\n", "\t", "\r", "\x0b", "\u2028", "\xa0", "."]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 50)))
        limit = rng.randint(1, 20)
        assert split_long_text(text, limit) == regex_split(text, limit), (text, limit)
    paragraphs = ["\n".join(" ".join(rng.choice(["rain", "river", "mill"]) for _ in range(rng.randint(1, 30)))
                            for _ in range(rng.randint(1, 4))) for _ in range(300)]
    book = "\ufeff" + "\n\n \n".join(paragraphs) + "\n"
    (tmp_path / "book.txt").write_text(book, encoding="utf-8")
    (tmp_path / "short.txt").write_text("short \n\n text")
    streamed = list(iter_documents(str(tmp_path), "text", 700))
    expected = [(f"book.txt#{k}", p) for k, p in enumerate(regex_split(book[1:], 700))] + [("short.txt",
                                                                                           "short \n\n text")]
    assert streamed == expected and len(expected) > 20


def test_invalid_utf8_after_a_bom_names_the_file_offset(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"\xef\xbb\xbfline one\nline \xff two\n")
    with pytest.raises(UserError, match=r"x.txt is not UTF-8 text \(byte 0xff at offset 17, line 2\)"):
        load_local_corpus(str(tmp_path), "text")
