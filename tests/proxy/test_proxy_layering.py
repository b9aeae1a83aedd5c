"""kvxfer.proxy is an application layer: what it may import, who may import it, its public names
(layer: tests)."""

from __future__ import annotations

import ast
import importlib
import pathlib

import kvxfer

PACKAGE = pathlib.Path(kvxfer.__file__).parent
PROXY = PACKAGE / "proxy"


def _kvxfer_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n == "kvxfer" or n.startswith("kvxfer.")}


def test_proxy_imports_only_itself_and_errors_from_kvxfer():
    for path in sorted(PROXY.glob("*.py")):
        bad = {n for n in _kvxfer_imports(path) if n != "kvxfer.errors" and not n.startswith("kvxfer.proxy")}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_only_the_cli_imports_the_proxy():
    importers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                       if PROXY not in p.parents and any(n.startswith("kvxfer.proxy") for n in _kvxfer_imports(p)))
    assert importers in ([], ["cli.py"])


def test_every_module_has_a_layer_docstring_and_a_sorted_resolvable_all():
    for path in sorted(PROXY.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and "(layer:" in doc.split("\n\n")[0], f"{path.name} lacks a layer docstring"
        if path.stem == "__main__":
            continue
        mod = importlib.import_module("kvxfer.proxy" if path.stem == "__init__" else f"kvxfer.proxy.{path.stem}")
        assert mod.__all__ == sorted(mod.__all__), path.name
        assert all(hasattr(mod, n) for n in mod.__all__), path.name
