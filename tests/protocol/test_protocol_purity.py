"""kvxfer.protocol stays pure: a static check of every import, and a curated sorted __all__."""

from __future__ import annotations

import ast
import pathlib

import kvxfer.protocol as protocol

ALLOWED_TOP = {"__future__", "hashlib", "hmac", "struct", "math", "secrets", "typing", "logging",
               "collections", "msgspec", "numpy"}
# hybridwire.py rebuilds a hybrid cache's groups: the pure layout modules that describe them
ALLOWED_KVXFER = ("kvxfer.errors", "kvxfer.types", "kvxfer.layout.spec", "kvxfer.protocol", "kvxfer.layout.carrier",
                  "kvxfer.layout.groups", "kvxfer.layout.state")


def imported_modules(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def test_protocol_imports_only_pure_modules():
    files = sorted(pathlib.Path(protocol.__file__).parent.glob("*.py"))
    assert len(files) >= 4
    for path in files:
        for name in imported_modules(path):
            ok = name.split(".")[0] in ALLOWED_TOP or name.startswith(ALLOWED_KVXFER)
            assert ok, f"{path.name} imports {name}"


def test_all_is_sorted_and_resolves():
    assert protocol.__all__ == sorted(protocol.__all__)
    for name in protocol.__all__:
        assert getattr(protocol, name) is not None
