"""The README's copy-paste snippets run as written (each ```python block preceded by a ``<!-- readme-test: NAME -->``
line), in a fresh interpreter on CPU, so the documented handoffs cannot drift from the code."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"<!-- readme-test: ([\w-]+) -->\n```python\n(.*?)```", re.S)


def _blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        return BLOCK.findall(f.read())


def test_readme_has_the_handoff_snippets():
    assert {"hf", "flashinfer", "vllm"} <= {name for name, _ in _blocks()}


@pytest.mark.parametrize("name,code", _blocks(), ids=[n for n, _ in _blocks()])
def test_readme_snippet_runs(name, code):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"README snippet {name!r} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
