"""Every relative Markdown link and image in the README and the guide under docs/ (every page, at any depth) points
to a file that exists, and every ``#anchor`` into a Markdown page names one of its headings (GitHub's slugs) or an
explicit ``<a id=...>``; docs/index.md lists every page of the guide."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.M | re.S)  # fenced code blocks: their text is not Markdown
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The page without fenced code blocks (a ``# comment`` there is no heading, a ``](x)`` no link)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but ``-`` and ``_`` dropped, spaces to
    hyphens (github-slugger)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = prose(page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for _, title in HEADING.findall(text):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings: x, x-1, x-2
    return out


def links(page: Path) -> list[str]:
    text = CODE_SPAN.sub(lambda m: m.group(0) if "](" not in m.group(0) else "", prose(page.read_text("utf-8")))
    return LINK.findall(text)


def test_slug_follows_github() -> None:
    assert slug("INT8 weights (`method.weight_dtype=int8`)") == "int8-weights-methodweight_dtypeint8"
    assert slug("Dry runs: memory for 125M → 13B without a GPU") == "dry-runs-memory-for-125m--13b-without-a-gpu"
    assert slug("The model's own tokenizer") == "the-models-own-tokenizer"
    assert slug("See [the guide](docs/index.md)") == "see-the-guide"


def test_relative_links_and_anchors_resolve() -> None:
    broken = []
    checked = 0
    for page in pages():
        for target in links(page):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            checked += 1
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)} -> {target} (no heading #{anchor} in {dest.name})")
    assert checked > 100, f"only {checked} links found: is the link pattern still right?"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_a_broken_anchor_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n## Two words\n\n```bash\n# not a heading\n```\n\n## Two words\n")
    assert anchors(page) == {"title", "two-words", "two-words-1"}
    assert links(page) == []


def report_folders() -> list[Path]:
    """Folders ``analysis.report`` wrote (``tables/`` inside): listed by their own index.md, their tables are not."""
    return [d for d in DOCS.iterdir() if (d / "tables").is_dir()]


def test_the_guide_lists_every_page() -> None:
    index = DOCS / "index.md"
    listed = {(DOCS / t.partition("#")[0]).resolve() for t in links(index) if "://" not in t}
    generated = report_folders()
    missing = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")
               if p != index and p.resolve() not in listed
               and not any(d in p.parents and p != d / "index.md" for d in generated)]
    assert not missing, f"docs/index.md does not list {missing}"
