"""The example in docs/layout.md, "Several KV-cache groups", runs and checks its own bytes."""

from __future__ import annotations

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "layout.md"


def test_the_several_groups_example_runs(capsys):
    text = DOC.read_text()
    section = text[text.index("## Several KV-cache groups"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, f"{DOC}:several-groups", "exec"), {})
    # full group: 7 blocks, sliding group: the 3 blocks of its window, state: one slot
    assert capsys.readouterr().out.strip() == "[27776, 11904, 2624]"
