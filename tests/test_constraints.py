"""``constraints.txt`` pins the tested environment: every package of pyproject's dependencies and ``test`` extra is
pinned inside its range, and the running environment has exactly the pinned versions (docs/install.md)."""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent


def pins() -> dict[str, Version]:
    """name -> pinned version of every ``name==version`` line (comments and blank lines skipped)."""
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier  # one exact pin per line, nothing else
            assert spec.operator == "==" and "*" not in spec.version, line
            out[canonicalize_name(req.name)] = Version(spec.version)
    return out


def declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["test"]]]


def test_every_declared_dependency_is_pinned_inside_its_range() -> None:
    pinned = pins()
    missing = [str(r) for r in declared() if canonicalize_name(r.name) not in pinned]
    assert not missing, f"not in constraints.txt: {missing}"
    outside = [f"{r} vs pin {pinned[canonicalize_name(r.name)]}" for r in declared()
               if not r.specifier.contains(pinned[canonicalize_name(r.name)], prereleases=True)]
    assert not outside, f"pins outside pyproject's ranges: {outside}"


def test_the_installed_versions_equal_the_pins() -> None:
    """A local tag (torch's ``+cpu`` / ``+cu128``) is the build, not the version: compared without it."""
    installed = {canonicalize_name(d.metadata["Name"]): Version(d.version) for d in md.distributions()}
    drift = [f"{name}: installed {installed.get(name)}, pinned {v}" for name, v in sorted(pins().items())
             if name not in installed or Version(installed[name].public) != v]
    assert not drift, "the environment differs from constraints.txt (see docs/install.md):\n" + "\n".join(drift)
