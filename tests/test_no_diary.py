"""No diary outside bench/RESULTS.md (docs/DESIGN.md §6): code, tests, the README and the design page state the
current decision and point to bench/RESULTS.md by topic; dates, session / run ordinals and issue numbers live only
there (its sections are titled by topic and date) and in the measurement files of ``bench/data/``.

The check greps every text file of the library packages, ``bench/`` (but its RESULTS.md and data), ``tests/``,
``docs/`` and README.md for an ISO date, an ordinal session / run label and an issue number, and fails naming
``file:line`` for each. A full ISO timestamp (date, ``T``, time) is data, e.g. a fixture's ``"date"`` field, and is
allowed; ``data/`` folders (measurements, the demo's texts) are not prose and are not read.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: folders read, when present (library packages first; a demo package ``jmixedkv_*`` or ``examples/`` too)
FOLDERS = ("jmixedkv", "interop", "pallas_kernels", "bench", "tests", "docs", "examples")
#: top-level files read
FILES = ("README.md",)
#: relative paths never read: the one place for dated, run-by-run history, and this file (it spells the ordinals)
EXEMPT = ("bench/RESULTS.md", "tests/test_no_diary.py")
TEXT = (".py", ".md", ".toml", ".cfg", ".txt", ".sh", ".yml", ".yaml")

ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
            "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth").split()
ORDINALS += [f"twenty-?{o}" for o in ORDINALS[:9]] + ["thirtieth"]
#: ordinals that have no use in this code base but as run labels ("tenth" .. "thirtieth"), matched bare
LABEL_ONLY = ORDINALS[9:]
#: "a second run of generate()" is plain English; "the fifth run" is a label
RUN_LABELS = ORDINALS[3:]

RULES = (
    ("ISO date", re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b(?!T\d\d:\d\d)")),
    ("session label", re.compile(r"\b(?:%s)[ -]sessions?\b" % "|".join(ORDINALS), re.I)),
    ("run label", re.compile(r"\b(?:%s)[ -]runs?\b" % "|".join(RUN_LABELS), re.I)),
    ("run ordinal", re.compile(r"\b(?:%s)\b" % "|".join(LABEL_ONLY))),
    ("issue number", re.compile(r"\bissue[ -]?#?\d+(?![\d%.]| instructions)", re.I)),
)


def _files():
    """Relative paths of every text file the rule covers."""
    for name in FILES:
        if os.path.isfile(os.path.join(ROOT, name)):
            yield name
    folders = list(FOLDERS) + sorted(d for d in os.listdir(ROOT) if d.startswith("jmixedkv_")
                                     and os.path.isdir(os.path.join(ROOT, d)))
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = sorted(d for d in dirnames if d not in ("data", "__pycache__") and not d.startswith("."))
            for f in sorted(filenames):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
                if f.endswith(TEXT) and rel not in EXEMPT:
                    yield rel


def diary_lines(text):
    """``[(line number, rule name, matched text)]``, the first mark of each line of ``text`` that carries one."""
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        for name, rule in RULES:
            m = rule.search(line)
            if m:
                hits.append((i, name, m.group(0)))
                break
    return hits


def test_rules_catch_each_kind_and_spare_plain_text():
    """The rules against hand-written marks and look-alikes."""
    caught = ["timings of 2026-12-01 on the H200", "the twenty-first session", "(nineteenth run)",
              "the fourth sessions' grid", "the first session", "the fifth run", "bench/RESULTS.md, sixteenth)",
              "Issue 18's target", "the issue-18 grid", "(issue #5)"]
    spared = ["ALU 79% busy, issue 81%, 89 registers", "a fixture date 2026-12-02T10:00:00+00:00", "SIXTH = 1/6",
              "the first token", "issue slots of the warp", "0.594 bytes per element", "PRs #20452 / #21021",
              "none for a second run of the same shapes", "the first run compiles", "jax 0.11.2, triton 3.6",
              "the kernel issues 437 instructions per block", "warps issue 4 instructions per cycle"]
    for s in caught:
        assert diary_lines(s), s
    for s in spared:
        assert not diary_lines(s), s


def test_no_dates_run_labels_or_issue_numbers():
    """Every covered file is free of diary marks; the failure names each ``file:line``."""
    files = list(_files())
    assert "README.md" in files and "docs/DESIGN.md" in files and any(f.startswith("jmixedkv/") for f in files)
    bad = []
    for rel in files:
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            for line, name, text in diary_lines(f.read()):
                bad.append(f"{rel}:{line}: {name} {text!r}")
    assert not bad, ("dates, run labels and issue numbers belong in bench/RESULTS.md only (docs/DESIGN.md §6); "
                     "state the decision and cite bench/RESULTS.md by topic:\n" + "\n".join(bad))
