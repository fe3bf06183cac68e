"""Peak RSS and time of building a large local corpus (``experiments.data.corpus.build_corpus``): read, split, train the
BPE, encode, write the token files, open them memory-mapped, draw batches.

A deterministic synthetic corpus of ``--size-mb`` MB is generated once under ``--workdir`` (Zipf-distributed
made-up words in sentences and paragraphs; half of the bytes as ``.txt`` "books" of ~2 MB, cut into pieces at
``data.chunk_chars``, half as one ``.jsonl`` of 2–20 kB rows). Each measurement runs in a fresh subprocess with
an empty cache (cold: every stage runs) and then again on that cache (warm: fingerprint pass + memmap), and
reports ``ru_maxrss`` after the imports and after ``build_corpus``, then draws 200 batches and reports RSS split
into anonymous memory and file-backed pages (the memory-mapped token files: page cache, reclaimable, but counted
in RSS; Linux may map a large folio around each row read). Linux only (``/proc/self/status``). ``--old REV``
measures the implementation at git revision REV instead (its ``experiments/{data,local_corpus,errors}.py`` are
extracted with ``git show`` into the work dir; nothing in the checkout changes), e.g. the in-memory one before
token files were memory-mapped::

    python benchmarks/data_rss.py --size-mb 100 --old a6232da   # old: all text and ids in Python lists
    python benchmarks/data_rss.py --size-mb 100
    python benchmarks/data_rss.py --size-mb 1000                # several minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def make_words(rng, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "tar", "en", "sol", "ri", "va", "dun", "pe", "gor", "shi", "al", "nu", "the", "bre"]
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables, size=rng.integers(1, 5))))
    return sorted(words)


def text_block(rng, tables, weights, n_words: int) -> str:
    """``n_words`` Zipf-distributed words; about one in 15 ends a sentence, one in 120 a paragraph."""
    import numpy as np

    ids = rng.choice(len(weights), size=n_words, p=weights)
    kind = np.where(rng.random(n_words) < 1 / 120, 2, np.where(rng.random(n_words) < 1 / 15, 1, 0))
    words = tables[kind, ids]
    return " ".join(words.tolist()).replace("\n\n ", "\n\n")


def generate(root: Path, size_mb: int, seed: int = 0) -> Path:
    """The corpus under ``root`` (generated once; ``DONE`` marks a complete one)."""
    import numpy as np

    if (root / "DONE").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    (root / "books").mkdir(parents=True)
    rng = np.random.default_rng(seed)
    words = make_words(rng, 20_000)
    weights = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    weights /= weights.sum()
    tables = np.array([words, [w + "." for w in words], [w + ".\n\n" for w in words]], dtype=object)
    target = size_mb * 10**6
    written, k = 0, 0
    while written < target // 2:  # books of ~2 MB
        text = text_block(rng, tables, weights, 2 * 10**6 // 7)
        (root / "books" / f"book{k:05d}.txt").write_text(text)
        written, k = written + len(text), k + 1
    with open(root / "rows.jsonl", "w") as f:
        while written < target:
            text = text_block(rng, tables, weights, int(rng.integers(300, 3000)))
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text)
    (root / "DONE").write_text(f"{written} characters\n")
    return root


def extract_old(rev: str, workdir: Path) -> Path:
    """``experiments/{__init__,data,local_corpus,errors}.py`` at ``rev`` as an importable package; its root."""
    root = workdir / f"old-{rev}"
    package = root / "experiments"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("__init__", "data", "local_corpus", "errors"):
        source = subprocess.run(["git", "show", f"{rev}:experiments/{name}.py"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout
        (package / f"{name}.py").write_text(source)
    return root


def child(args) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import resource

    sys.path.insert(0, args.import_root)
    import numpy as np  # noqa: F401  (imports counted in the baseline)
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from experiments.data.corpus import build_corpus

    def rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    baseline = rss()
    t0 = time.perf_counter()
    corpus = build_corpus(path=args.corpus, text_field="text", val_fraction=0.05, vocab_size=args.vocab,
                          seq_len=args.seq_len, batch_size=8, seed=0, cache_dir=args.cache, chunk_chars=16_000)
    built_s = time.perf_counter() - t0
    built_rss = rss()
    t1 = time.perf_counter()
    for step in range(200):
        corpus.train.batch(step)
    batch_ms = (time.perf_counter() - t1) / 200 * 1e3
    status = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in open("/proc/self/status"))
              if k in ("RssAnon", "RssFile")}
    print(json.dumps({"build_s": round(built_s, 1), "rss_after_imports_mib": round(baseline / MIB),
                      "peak_rss_build_mib": round(built_rss / MIB), "peak_rss_mib": round(rss() / MIB),
                      "anon_mib": round(status["RssAnon"] / MIB), "file_mib": round(status["RssFile"] / MIB),
                      "batch_ms": round(batch_ms, 3),
                      "train_tokens": corpus.stats["train_tokens"], "val_tokens": corpus.stats["val_tokens"],
                      "docs": corpus.stats["train_docs"] + corpus.stats["val_docs"]}))


def measure(corpus: Path, import_root: Path, cache: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--corpus", str(corpus), "--import-root", str(import_root),
           "--cache", str(cache), "--vocab", str(args.vocab), "--seq-len", str(args.seq_len)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=100)
    p.add_argument("--workdir", default="/tmp/hmt_data_rss")
    p.add_argument("--old", metavar="REV", help="measure experiments/data/corpus.py at this git revision instead")
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--import-root", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    workdir = Path(args.workdir)
    t0 = time.perf_counter()
    corpus = generate(workdir / f"corpus-{args.size_mb}mb", args.size_mb)
    size = sum(f.stat().st_size for f in corpus.rglob("*") if f.suffix in (".txt", ".jsonl"))
    print(f"corpus: {corpus} ({size / 10**6:.0f} MB on disk; ready in {time.perf_counter() - t0:.0f} s)")
    import_root = extract_old(args.old, workdir) if args.old else REPO
    label = f"old ({args.old})" if args.old else "new"
    cache = workdir / f"cache-{label.split()[0]}-{args.size_mb}mb"
    shutil.rmtree(cache, ignore_errors=True)
    for phase in ("cold", "warm"):
        r = measure(corpus, import_root, cache, args)
        print(f"{label:>14} {phase}: build {r['build_s']:6.1f} s, peak RSS {r['peak_rss_build_mib']:5d} MiB "
              f"(imports alone {r['rss_after_imports_mib']} MiB); after 200 batches ({r['batch_ms']:.3f} ms each) "
              f"{r['peak_rss_mib']} MiB = {r['anon_mib']} anonymous + {r['file_mib']} file-backed; "
              f"{r['train_tokens']:,} + {r['val_tokens']:,} tokens, {r['docs']:,} documents", flush=True)
    cached = sum(f.stat().st_size for f in cache.iterdir()) if cache.exists() else 0
    print(f"cache: {cache} ({cached / MIB:.0f} MiB)")
    if not os.environ.get("KEEP_CACHE"):
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
