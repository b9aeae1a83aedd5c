"""Every example in examples/ runs to completion (each checks its own result and exits non-zero if wrong)."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted(pathlib.Path(__file__).resolve().parent.parent.joinpath("examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=path.parent.parent)
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_there_are_examples():
    assert len(EXAMPLES) >= 2
