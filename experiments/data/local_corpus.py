"""A user's own corpus from local files: ``.txt`` (one document per file), ``.jsonl``/``.json`` (one document per
row/object), ``.parquet`` (one per row), read without network or progress bars, every defect named by file.

Streaming: ``iter_documents`` yields one (id, text) at a time and never holds the corpus. A ``.txt`` file is
read line by line (memory: one piece plus the longest line), a ``.jsonl`` file row by row, a ``.parquet`` file
one record batch at a time; only a ``.json`` file (one JSON value) is parsed whole, one file at a time.

Large documents are cut into pieces so that a corpus of one file (a book) or of a few files still has a
validation split: a document longer than ``chunk_chars`` characters is cut at paragraph boundaries (blank
lines; a paragraph longer than the limit at line ends, then hard) and the paragraphs are packed greedily into
pieces of at most ``chunk_chars`` characters, each piece keeping the document's id plus ``#<k>``. The
train/validation split then treats every piece as a document (``experiments.data.corpus``).

Bad input raises ``UserError`` naming the file (and line): an empty file, a binary or non-UTF-8 file, a JSONL
line that is not JSON, a row without the text field or whose text is not a string.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from experiments.errors import UserError

KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
BOM = b"\xef\xbb\xbf"


def corpus_files(path: str, exclude: Path | None = None) -> list[Path]:
    """The corpus files at ``path`` (a file, or every matching file below a directory, in sorted order), none
    below ``exclude`` (the token cache, when it lies inside the corpus directory)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"data.path does not exist: {root}")
    if root.is_file():
        if root.suffix not in KINDS:
            raise UserError(f"data.path={root}: unsupported file type {root.suffix!r} (use .txt, .jsonl, .json or "
                            ".parquet)")
        return [root]
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in KINDS and not p.name.startswith(".")
                   and not (exclude is not None and p.resolve().is_relative_to(exclude)))
    if not files:
        raise UserError(f"data.path has no .txt/.jsonl/.json/.parquet files: {root}")
    return files


def iter_lines(path: Path) -> Iterator[str]:
    """The file's lines as ``text.split("\\n")`` gives them (a BOM dropped), decoded as UTF-8 one line at a time;
    ``UserError`` for binary content or invalid UTF-8 (file offset and line named)."""
    with open(path, "rb") as f:
        if b"\x00" in f.read(65536):
            raise UserError(f"data.path: {path} looks binary (NUL bytes), not text")
        f.seek(0)
        offset, ended = 0, True
        for number, raw in enumerate(f, start=1):
            body = raw[len(BOM):] if number == 1 and raw.startswith(BOM) else raw
            try:
                line = body.decode("utf-8")
            except UnicodeDecodeError as e:
                at = offset + len(raw) - len(body) + e.start
                raise UserError(f"data.path: {path} is not UTF-8 text (byte 0x{body[e.start]:02x} at offset {at}, "
                                f"line {number}); convert it, e.g. iconv -f latin1 -t utf-8") from None
            offset += len(raw)
            ended = line.endswith("\n")
            yield line[:-1] if ended else line
        if ended:
            yield ""


def read_text_file(path: Path) -> str:
    """The whole file's text, decoded as UTF-8 (a BOM dropped); ``UserError`` for binary or non-UTF-8 content."""
    return "\n".join(iter_lines(path))


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


def _jsonl_rows(path: Path, text_field: str, lines: Iterable[str]) -> Iterator[str]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"data.path: {path} line {number} is not JSON ({e.msg} at column {e.colno})") from None
        yield _row_text(row, text_field, f"{path} line {number}")


def read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    """The text of every row of a JSON Lines file, one line at a time."""
    return _jsonl_rows(path, text_field, iter_lines(path))


def read_json(path: Path, text_field: str) -> Iterator[str]:
    """A JSON array of objects, one object, or (as ``datasets`` also accepts) JSON Lines in a .json file."""
    text = read_text_file(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        yield from _jsonl_rows(path, text_field, text.split("\n"))
        return
    del text
    rows = value if isinstance(value, list) else [value]
    for i, row in enumerate(rows):
        yield _row_text(row, text_field, f"{path} item {i}")


def read_parquet(path: Path, text_field: str, batch_rows: int = 1024) -> Iterator[str]:
    """The ``text_field`` column of a Parquet file, ``batch_rows`` rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"data.path: {path} is not a readable Parquet file ({e})") from None
    if text_field not in parquet.schema_arrow.names:
        raise UserError(f"data.path: {path} has no column data.text_field={text_field!r} (columns: "
                        f"{parquet.schema_arrow.names[:10]})")
    i = 0
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise UserError(f"data.path: {path} row {i} column {text_field!r} is {type(text).__name__}, "
                                "not a string")
            yield text
            i += 1


# ------------------------------------------------------------------------------------------- cutting documents
def _pack(units: Iterable[str], max_chars: int) -> Iterator[str]:
    """Non-blank ``units`` (each at most ``max_chars``) joined by blank lines into pieces of at most ``max_chars``."""
    current: list[str] = []
    size = 0
    for unit in units:
        if not unit.strip():
            continue
        grown = size + 2 + len(unit) if current else len(unit)
        if grown <= max_chars:
            current.append(unit)
            size = grown
        else:
            yield "\n\n".join(current)
            current, size = [unit], len(unit)
    if current:
        yield "\n\n".join(current)


def _units(lines: Iterable[str], max_chars: int) -> Iterator[str]:
    """Paragraph units of the text whose ``split("\\n")`` is ``lines``: paragraphs are separated by lines that are
    blank (whitespace only), except the first and the last line, exactly as ``re.split(r"\\n\\s*\\n", text)``
    separates them; a paragraph longer than ``max_chars`` becomes its lines, each cut every ``max_chars``."""
    paragraph: list[str] = []
    size, long = -1, False

    def cut(line: str) -> list[str]:
        return [line[i : i + max_chars] for i in range(0, max(len(line), 1), max_chars)]

    it = iter(lines)
    line = next(it, None)
    k = 0
    while line is not None:
        following = next(it, None)
        if 0 < k and following is not None and not line.strip():  # a paragraph break
            if paragraph:
                yield "\n".join(paragraph)
            paragraph, size, long = [], -1, False
        elif long:
            yield from cut(line)
        else:
            paragraph.append(line)
            size += len(line) + 1
            if size > max_chars:
                long = True
                for held in paragraph:
                    yield from cut(held)
                paragraph = []
        line, k = following, k + 1
    if paragraph:
        yield "\n".join(paragraph)


def split_long_text(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars`` characters at paragraph (then line, then any) boundaries."""
    if max_chars <= 0 or len(text) <= max_chars:
        return [text]
    return list(_pack(_units(text.split("\n"), max_chars), max_chars)) or [text]


def _text_file_documents(path: Path, name: str, max_chars: int) -> Iterator[tuple[str, str]]:
    """A .txt file as one document, or as pieces ``name#k`` when it is longer than ``max_chars``, streamed. The
    raw lines are kept only until a second piece shows that the file is cut (one piece: the file's own text)."""
    if max_chars <= 0:
        text = read_text_file(path)
        if text.strip():
            yield name, text
        return
    raw: list[str] | None = []

    def lines() -> Iterator[str]:
        for line in iter_lines(path):
            if raw is not None:
                raw.append(line)
            yield line

    pieces = _pack(_units(lines(), max_chars), max_chars)
    first = next(pieces, None)
    second = next(pieces, None)
    if second is None:
        text = "\n".join(raw)
        if text.strip():
            yield name, text
        return
    raw = None
    yield f"{name}#0", first
    yield f"{name}#1", second
    for k, piece in enumerate(pieces, start=2):
        yield f"{name}#{k}", piece


def iter_documents(path: str, text_field: str, chunk_chars: int = 0, *, warn: bool = True,
                   files: list[Path] | None = None) -> Iterator[tuple[str, str]]:
    """(document id, text) for every document (or piece, see ``split_long_text``) of the corpus at ``path`` (its
    ``files``, default ``corpus_files(path)``), in file order, streamed. Empty documents are dropped (with a
    warning per file that has none, when ``warn``); a corpus with no text at all is an error, raised once
    everything was read."""
    files = corpus_files(path) if files is None else files
    root = Path(path).expanduser()
    total = 0
    for f in files:
        name = f.name if root.is_file() else str(f.relative_to(root))
        kind = KINDS[f.suffix]
        count = 0
        if kind == "text":
            docs: Iterable[tuple[str, str]] = _text_file_documents(f, name, chunk_chars)
        else:
            rows = {"jsonl": read_jsonl, "json": read_json, "parquet": read_parquet}[kind](f, text_field)
            docs = _row_documents(rows, name, chunk_chars)
        for doc in docs:
            count += 1
            yield doc
        total += count
        if not count and len(files) > 1 and warn:
            print(f"warning: data.path: {f} has no text; skipped", file=sys.stderr)
    if not total:
        raise UserError(f"data.path: {path} has no text (empty file{'s' if len(files) > 1 else ''})")


def _row_documents(rows: Iterable[str], name: str, max_chars: int) -> Iterator[tuple[str, str]]:
    for i, text in enumerate(rows):
        if not text.strip():
            continue
        pieces = split_long_text(text, max_chars)
        if len(pieces) == 1:
            yield f"{name}:{i}", text
        else:
            yield from ((f"{name}:{i}#{k}", piece) for k, piece in enumerate(pieces))

