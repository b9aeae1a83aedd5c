"""docs/compatibility.md is what scripts/compat_matrix.py generates from the test suite's ``compat`` markers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("compat_matrix", ROOT / "scripts" / "compat_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_compatibility_doc_is_current():
    script = _script()
    assert (ROOT / "docs" / "compatibility.md").read_text() == script.render(script.collect()), \
        "docs/compatibility.md is not current: run python scripts/compat_matrix.py"


def test_every_cross_engine_direction_has_a_row():
    rows = _script().collect()
    pairs = {(r.fields["producer"], r.fields["consumer"]) for r in rows if not r.xfail}
    assert {("transformers", "transformers"), ("transformers", "vLLM"), ("vLLM", "transformers"),
            ("vLLM", "vLLM")} <= pairs
    assert any(r.fields["device"].startswith("GPU") for r in rows)


def test_a_marker_missing_a_field_is_an_error(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.compat(producer='a', consumer='b')\ndef test_y():\n    pass\n")
    script = _script()
    script.ELSEWHERE = []
    try:
        script.collect(tmp_path)
    except ValueError as exc:
        assert "lacks ['tp', 'layout', 'path', 'device']" in str(exc)
    else:
        raise AssertionError("a marker without its fields was accepted")
