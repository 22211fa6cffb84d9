"""The README's copy-paste snippets run as written (each ```python block preceded by a ``<!-- readme-test: NAME -->``
line), in a fresh interpreter on CPU, so the documented handoffs cannot drift from the code; the first one, a
newcomer's first paste, also runs in seconds."""
import os
import re
import resource
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"<!-- readme-test: ([\w-]+) -->\n```python\n(.*?)```", re.S)
#: CPU seconds (user + system, so a loaded machine does not count) the README's first example may take; it takes
#: about 8 on a 2-core CPU (import, then a handful of compiles)
FIRST_EXAMPLE_CPU_S = 30.0


def _blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        return BLOCK.findall(f.read())


def _run(code):
    """Run ``code`` in a fresh CPU interpreter: ``(CompletedProcess, CPU seconds it used)``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_readme_has_the_handoff_snippets():
    names = [name for name, _ in _blocks()]
    assert {"hf", "engines"} <= set(names)
    assert names[0] == "first", f"the README's first snippet is {names[0]!r}, not the small first example"


def test_first_example_is_small_and_fast():
    """The first example shows a write, the fused read and the staged read on a small pool, in seconds."""
    name, code = _blocks()[0]
    for call in ("jm.init_state(", "jm.append(", "jm.decode_attention(", "jm.stage("):
        assert call in code, f"the first example lost {call}"
    r, cpu_s = _run(code)
    assert r.returncode == 0, f"README snippet {name!r} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert cpu_s < FIRST_EXAMPLE_CPU_S, f"the README's first example took {cpu_s:.1f} CPU s (> {FIRST_EXAMPLE_CPU_S})"


@pytest.mark.parametrize("name,code", _blocks()[1:], ids=[n for n, _ in _blocks()[1:]])
def test_readme_snippet_runs(name, code):
    r, _ = _run(code)
    assert r.returncode == 0, f"README snippet {name!r} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
