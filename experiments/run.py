"""``python -m experiments.run method=<name> model=<phase> [key=value ...]`` — the Hydra app.

Composes ``experiments/conf/run.yaml``, validates it into frozen dataclasses (bad input fails here, before any
compute and before anything is written), then trains (``mode=train``) and writes ``results/<run_id>/``
(``experiments.execute.main_with_config``; run ids, preflight and the summary: ``experiments.runs``).
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig

from experiments.errors import exit_with_error
from experiments.execute import main_with_config


@hydra.main(version_base=None, config_path="conf", config_name="run")
def main(cfg: DictConfig) -> None:
    main_with_config(cfg)


def check_overrides(args: list[str]) -> None:
    """Parse the ``key=value`` arguments as Hydra will, so an unquoted ``~``, non-ASCII letter or other special
    character ends in one ``error:`` line with the quoting that works, not in Hydra's lexer report."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return  # Hydra's own report, with its stack trace
    parser = OverridesParser.create()
    for arg in args:
        if "=" in arg and not arg.startswith("-"):
            try:
                parser.parse_overrides([arg])
            except OverrideParseException:
                key, _, value = arg.partition("=")
                exit_with_error(f"cannot parse the override {arg!r}: quote a value holding ~, non-ASCII letters "
                                f"or other special characters, e.g. '{key}=\"{value}\"' (double quotes "
                                "for Hydra, single quotes around them for the shell; docs/command_line.md)")


if __name__ == "__main__":
    check_overrides(sys.argv[1:])
    main()
