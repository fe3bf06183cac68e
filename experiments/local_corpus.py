"""A user's own corpus from local files: ``.txt`` (one document per file), ``.jsonl``/``.json`` (one document per
row/object), ``.parquet`` (one per row), read without network or progress bars, every defect named by file.

Large documents are cut into pieces so that a corpus of one file (a book) or of a few files still has a
validation split: a document longer than ``chunk_chars`` characters is cut at paragraph boundaries (blank
lines; a paragraph longer than the limit at line ends, then hard) and the paragraphs are packed greedily into
pieces of at most ``chunk_chars`` characters, each piece keeping the document's id plus ``#<k>``. The
train/validation split then treats every piece as a document (``experiments.data.split_documents``).

Bad input raises ``UserError`` naming the file (and line): an empty file, a binary or non-UTF-8 file, a JSONL
line that is not JSON, a row without the text field or whose text is not a string.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from experiments.errors import UserError

KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def corpus_files(path: str) -> list[Path]:
    """The corpus files at ``path`` (a file, or every matching file below a directory, in sorted order)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"data.path does not exist: {root}")
    if root.is_file():
        if root.suffix not in KINDS:
            raise UserError(f"data.path={root}: unsupported file type {root.suffix!r} (use .txt, .jsonl, .json or "
                            ".parquet)")
        return [root]
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in KINDS and not p.name.startswith("."))
    if not files:
        raise UserError(f"data.path has no .txt/.jsonl/.json/.parquet files: {root}")
    return files


def read_text_file(path: Path) -> str:
    """The file's text, decoded as UTF-8 (a BOM is dropped); ``UserError`` for binary or non-UTF-8 content."""
    data = path.read_bytes()
    if b"\x00" in data[:65536]:
        raise UserError(f"data.path: {path} looks binary (NUL bytes), not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"data.path: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, "
                        f"line {line}); convert it, e.g. iconv -f latin1 -t utf-8") from None


def _row_text(row, text_field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise UserError(f"data.path: {where} is a JSON {type(row).__name__}, not an object with a "
                        f"{text_field!r} field")
    if text_field not in row:
        raise UserError(f"data.path: {where} has no field data.text_field={text_field!r} (fields: "
                        f"{sorted(row)[:10]})")
    text = row[text_field]
    if not isinstance(text, str):
        raise UserError(f"data.path: {where} field {text_field!r} is {type(text).__name__}, not a string")
    return text


def read_jsonl(path: Path, text_field: str) -> list[str]:
    texts = []
    for number, line in enumerate(read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"data.path: {path} line {number} is not JSON ({e.msg} at column {e.colno})") from None
        texts.append(_row_text(row, text_field, f"{path} line {number}"))
    return texts


def read_json(path: Path, text_field: str) -> list[str]:
    """A JSON array of objects, one object, or (as ``datasets`` also accepts) JSON Lines in a .json file."""
    text = read_text_file(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return read_jsonl(path, text_field)
    rows = value if isinstance(value, list) else [value]
    return [_row_text(row, text_field, f"{path} item {i}") for i, row in enumerate(rows)]


def read_parquet(path: Path, text_field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"data.path: {path} is not a readable Parquet file ({e})") from None
    if text_field not in schema.names:
        raise UserError(f"data.path: {path} has no column data.text_field={text_field!r} (columns: "
                        f"{schema.names[:10]})")
    column = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    for i, text in enumerate(column):
        if not isinstance(text, str):
            raise UserError(f"data.path: {path} row {i} column {text_field!r} is {type(text).__name__}, not a string")
    return column


def split_long_text(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars`` characters at paragraph (then line, then any) boundaries."""
    if max_chars <= 0 or len(text) <= max_chars:
        return [text]
    units: list[str] = []
    for paragraph in PARAGRAPH_BREAK.split(text):
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
    if current:
        pieces.append(current)
    return pieces or [text]


def load_local_texts(path: str, text_field: str) -> list[tuple[str, str]]:
    """(document id, text) for every document of the corpus at ``path``; empty documents are dropped (an empty
    file is an error when it is the whole corpus)."""
    files = corpus_files(path)
    docs: list[tuple[str, str]] = []
    root = Path(path).expanduser()
    for f in files:
        name = f.name if root.is_file() else str(f.relative_to(root))
        kind = KINDS[f.suffix]
        if kind == "text":
            texts = [read_text_file(f)]
        elif kind == "jsonl":
            texts = read_jsonl(f, text_field)
        elif kind == "json":
            texts = read_json(f, text_field)
        else:
            texts = read_parquet(f, text_field)
        kept = [(name if kind == "text" else f"{name}:{i}", t) for i, t in enumerate(texts) if t.strip()]
        if not kept and len(files) > 1:
            print(f"warning: data.path: {f} has no text; skipped", file=sys.stderr)
        docs += kept
    if not docs:
        raise UserError(f"data.path: {path} has no text (empty file{'s' if len(files) > 1 else ''})")
    return docs
