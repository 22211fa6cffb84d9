"""The tests run from wherever the package sits: from a checkout, and from an unpacked sdist (CI's ``.ci/run``
unpacks the sdist and runs this file there first, so the package, the tests and ``bench/`` must come from that
tree, not from the checkout's editable install)."""
import os

import jmixedkv
import jmixedkv_demo

TESTS = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(TESTS)


def test_package_and_tests_come_from_one_tree():
    for mod in (jmixedkv, jmixedkv_demo):
        assert os.path.abspath(mod.__file__).startswith(TREE + os.sep), (mod.__file__, TREE)


def test_tree_carries_what_the_tests_read():
    for rel in ("LICENSE", "README.md", "Makefile", "docs/DESIGN.md", "bench/common.py", "pyproject.toml",
                "jmixedkv_demo/data/prose.txt"):
        assert os.path.isfile(os.path.join(TREE, rel)), rel
