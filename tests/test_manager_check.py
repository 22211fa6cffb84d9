"""`CacheManager.check_append` (vectorized over tokens) against a per-slot reference loop: the same refusal
(type and message, naming the same slot / positions) or the same new pages per slot, on managers with admitted,
idle, forked (shared pages) and partly filled slots and random token sets (bad slots, gaps, duplicates, negative
positions, positions off kv_len, past the page table, short pools)."""
import numpy as np
from hypothesis import given, settings, strategies as hs

from jmixedkv import CacheManager, GroupSpec, KVCacheConfig
from jmixedkv.checks import CacheCapacityError

PAGE = 4
CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=4, page_size=PAGE, max_draft_len=2)
SPEC = GroupSpec(num_layers=1, num_kv_heads=1, head_dim=16)
S, W = 5, 6


def reference_check(m: CacheManager, seq_slots, positions, capacity=True):
    """The per-slot loop `check_append` is checked against (refusal order: unadmitted slots, negative positions,
    page-table width; then per slot in increasing id: broken positions, a shared page, off kv_len; capacity)."""
    seq, pos = m.host_tokens(seq_slots, positions, "append")
    bad = sorted({int(s) for s in seq[seq >= 0] if not m._active[s]})
    if bad:
        raise ValueError(f"append: sequence slots {bad} are not admitted")
    if (pos[seq >= 0] < 0).any():
        raise ValueError(f"append: negative positions {sorted(set(pos[(seq >= 0) & (pos < 0)].tolist()))}")
    limit = m.state.max_pages_per_seq * m.config.page_size
    if (pos[seq >= 0] >= limit).any():
        raise CacheCapacityError(f"append: position {int(pos[seq >= 0].max())} is past the page table's width "
                                 f"({m.state.max_pages_per_seq} pages x {m.config.page_size} = {limit} tokens)")
    need = {}
    for s in np.unique(seq[seq >= 0]):
        p = np.sort(pos[seq == s])
        if np.unique(p).size != p.size or p[-1] - p[0] + 1 != p.size:
            raise ValueError(f"append: slot {s}: positions must be distinct and contiguous, got "
                             f"{p[:16].tolist()}{'...' if p.size > 16 else ''}")
        col = m.config.twin.high_column(p)
        width = m._hshared.shape[1]
        if m._shared[s, p // PAGE].any() or (width and ((col >= 0) & m._hshared[s, np.clip(col, 0, width - 1)]).any()):
            raise ValueError(f"append: slot {s}: positions [{p[0]}, {p[-1]}] write into a page shared with "
                             f"another sequence or the prefix index (fork / prefix reuse); shared pages are "
                             f"never written (copy-on-write happens at fork / admit)")
        n = int(m._lens[s])
        if not p[0] <= n <= p[-1] + 1:
            raise ValueError(f"append: slot {s} has kv_len {n}; positions [{p[0]}, {p[-1]}] must start at or "
                             f"before it and reach it (extend from kv_len, or rewrite a suffix ending at "
                             f"kv_len - 1 or later)")
        need[int(s)] = max(0, int(p[-1]) // PAGE + 1 - int(m._pages_held[s]))
    total = sum(need.values())
    if capacity and total > m.free_pages:
        detail = ", ".join(f"slot {s} needs {n}" for s, n in need.items() if n)
        raise CacheCapacityError(f"append needs {total} new low pages but only {m.free_pages} are free "
                                 f"(short by {total - m.free_pages}: {detail})")
    return need


def _outcome(fn, *args, **kw):
    try:
        return ("ok", fn(*args, **kw))
    except ValueError as e:                      # CacheCapacityError included
        return (type(e).__name__, str(e))


def _manager(num_pages: int) -> CacheManager:
    """Slot 0: 9 tokens; slot 1: fork of slot 0 (shares pages below its rewind floor); slot 2: 3 tokens;
    slot 3 admitted and empty; slot 4 idle."""
    m = CacheManager(CFG, SPEC, num_pages, S, W, backend="reference")
    k = np.ones((1, 9, 1, 16), np.float32)
    m.admit(0)
    m.append(None, k, k, [0] * 9, range(9))
    m.fork(0, 1)
    m.admit(2)
    m.append(None, k[:, :3], k[:, :3], [2] * 3, range(3))
    m.admit(3)
    return m


MANAGERS = {n: _manager(n) for n in (8, 64)}
run = hs.tuples(hs.sampled_from([0, 0, 1, 1, 2, 3, -1, 4]), hs.integers(-10, 2), hs.integers(1, 6))
noise = hs.lists(hs.tuples(hs.integers(-1, S - 1), hs.integers(-2, W * PAGE + 1)), max_size=1)


def _tokens(m, runs, extra):
    """Runs ``(slot, start - kv_len, length)`` of consecutive positions, plus ``extra`` stray tokens."""
    seq, pos = [], []
    for s, delta, n in runs:
        start = (m.kv_len(s) if 0 <= s < S else 0) + delta
        seq += [s] * n
        pos += range(start, start + n)
    for s, p in extra:
        seq.append(s)
        pos.append(p)
    return np.asarray(seq, np.int32), np.asarray(pos, np.int32)


@settings(max_examples=300, deadline=None)
@given(runs=hs.lists(run, min_size=1, max_size=4), extra=noise, pages=hs.sampled_from(sorted(MANAGERS)),
       capacity=hs.booleans())
def test_check_append_equals_the_per_slot_reference(runs, extra, pages, capacity):
    m = MANAGERS[pages]
    seq, pos = _tokens(m, runs, extra)
    assert _outcome(m.check_append, seq, pos, capacity) == _outcome(reference_check, m, seq, pos, capacity)


@settings(max_examples=150, deadline=None)
@given(slots=hs.lists(hs.sampled_from([0, 1, 2, 3]), min_size=1, max_size=4, unique=True),
       extra=hs.lists(hs.integers(0, 9), min_size=4, max_size=4), pages=hs.sampled_from(sorted(MANAGERS)))
def test_legal_appends_agree_and_pages_needed_matches(slots, extra, pages):
    """Legal extends from kv_len (the common engine call): same new pages; `pages_needed` agrees."""
    m = MANAGERS[pages]
    seq = np.concatenate([np.full(extra[i] + 1, s, np.int32) for i, s in enumerate(slots)])
    pos = np.concatenate([m.kv_len(s) + np.arange(extra[i] + 1, dtype=np.int32) for i, s in enumerate(slots)])
    want = _outcome(reference_check, m, seq, pos)
    assert _outcome(m.check_append, seq, pos) == want
    if want[0] == "ok":
        assert m.pages_needed(seq, pos) == want[1]


def test_shared_page_refusal_names_the_forked_slot():
    m = MANAGERS[64]
    assert m._shared[1].any()                    # the fork shares slot 0's first page
    err = _outcome(m.check_append, [3, 1], [0, 0])
    assert err[0] == "ValueError" and "slot 1: positions [0, 0] write into a page shared" in err[1]
