"""The layout of the code (docs/design/layout.md): import contracts, no import cycles, and a size ratchet.

- the layers (``[tool.importlinter]`` in pyproject.toml): hmt_core < baselines < experiments < analysis,
  benchmarks, hydra_plugins.hmt_sweeper; checked by import-linter, the report printed on failure;
- no cycle between modules: grimp's import graph (imports inside functions included) has no strongly connected
  component of more than one module;
- files over 400 lines and functions over 60 lines in hmt_core/ and experiments/: the current ones are listed with
  their sizes in tests/layout_sizes.json; a new one, or a listed one that grew, fails. Shrinking one is welcome:
  lower (or remove) its entry in the same commit.
"""

import ast
import contextlib
import io
import json
from pathlib import Path

import grimp
import networkx as nx
from importlinter import configuration
from importlinter.application.use_cases import lint_imports

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("hmt_core", "baselines", "experiments", "analysis", "benchmarks", "hydra_plugins.hmt_sweeper")
SIZED = ("hmt_core", "experiments")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
SIZES = REPO / "tests" / "layout_sizes.json"


def test_layers_hold():
    configuration.configure()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        kept = lint_imports(config_filename=str(REPO / "pyproject.toml"), cache_dir=None, no_logo=True)
    assert kept, out.getvalue()


def test_no_import_cycles():
    graph = grimp.build_graph(*ROOTS, include_external_packages=False, cache_dir=None)
    edges = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            edges.add_edge(module, imported)
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(edges) if len(c) > 1)
    assert not cycles, "modules importing each other (directly or round a loop):\n" + "\n".join(map(" ".join, cycles))


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function, nested ones and methods included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def measured_sizes() -> dict[str, dict[str, int]]:
    """Files over MAX_FILE_LINES and functions over MAX_FUNCTION_LINES in SIZED, by path (and qualified name)."""
    files, functions = {}, {}
    for package in SIZED:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            text = path.read_text()
            if (n := len(text.splitlines())) > MAX_FILE_LINES:
                files[rel] = n
            for name, n in _functions(ast.parse(text)):
                if n > MAX_FUNCTION_LINES:
                    functions[f"{rel}:{name}"] = n
    return {"files": files, "functions": functions}


def test_size_ratchet():
    allowed = json.loads(SIZES.read_text())
    now = measured_sizes()
    print(json.dumps(now, indent=1))
    worse = [f"{kind[:-1]} {name}: {n} lines (listed: {allowed[kind].get(name, 'not listed')})"
             for kind in ("files", "functions") for name, n in now[kind].items() if n > allowed[kind].get(name, 0)]
    assert not worse, ("new or grown past the limits (files ≤ 400 lines, functions ≤ 60 in hmt_core/ and "
                       "experiments/; split it, or shrink something else):\n" + "\n".join(worse))


def test_the_harness_asks_a_method_not_its_name():
    """What the harness needs of a method it asks the method (``hmt_core.method``: ``Method``, ``MethodConfig``), never
    its type or name: no ``isinstance`` of HMT's classes and no comparison of a method's name outside the one
    registry (``experiments/methods.py``) and each method's own module (docs/design/layout.md)."""
    import re

    from experiments import methods

    names = "|".join(methods.MODULES)
    pattern = re.compile(rf"isinstance\([^)]*HMT|\bname\s*(==|!=)\s*\"({names})\"|\"({names})\"\s*(==|!=)\s*\S*name\b")
    found = []
    for package in ("experiments", "baselines"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == "experiments/methods.py":
                continue
            found += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if pattern.search(line)]
    assert not found, "\n".join(found)
