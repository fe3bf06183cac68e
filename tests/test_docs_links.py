"""Every relative Markdown link in the README and the guide under docs/ points to a file that exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs").glob("*/index.md"))]


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_guide_lists_every_page():
    index = (REPO / "docs" / "index.md").read_text()
    missing = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "index.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/index.md does not list {missing}"
