"""``python -m experiments.model_cards docs/model_cards.md`` — rewrite the page's generated table of the cards."""

from __future__ import annotations

import sys
from pathlib import Path

from experiments.errors import exit_with_error
from experiments.model_cards import with_docs_block
from experiments.results import atomic_write_text


def main(argv: list[str]) -> None:
    page = Path(argv[0] if argv else "docs/model_cards.md")
    try:
        atomic_write_text(page, with_docs_block(page.read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        exit_with_error(f"{page}: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
