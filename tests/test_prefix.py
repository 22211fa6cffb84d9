"""Prefix reuse (`jmixedkv.prefix`): content keys, admit-with-prefix, fork, and a hypothesis state machine that
checks every live sequence reads bit-exactly what a cache without reuse gives it, refcounts balance, and pages
evicted to the host tier come back byte-identical."""
import jax
import numpy as np
import pytest

import jmixedkv
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jmixedkv.checks import CacheCapacityError
from jmixedkv.prefix import admit_with_prefix, page_keys
from jmixedkv.state import ERR_BAD_SLOT, ERR_HIGH_OOM, admit
from helpers import (BASES, CFG, GROUPS, MAX_PAGES, MAX_TOKENS, PAGE, SLOTS, cache_append, host_bytes, new_cache,
                     new_shadow, page_bytes, pages_bytes, prefix_state, read_all, shadow_append)


# ------------------------------------------------------------------------------------------------ unit tests
def test_page_keys_chain_and_salt():
    toks = list(range(13))
    keys = page_keys(toks, 4)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert page_keys(toks[:8], 4) == keys[:2]                        # a key names its whole prefix
    other = page_keys([99] + toks[1:], 4)
    assert all(a != b for a, b in zip(keys, other))                  # a change in page 0 changes every key
    assert page_keys(toks, 4, salt="tenant-a") != keys
    assert page_keys(toks, 4, salt="tenant-a") == page_keys(toks, 4, salt=b"tenant-a")
    assert page_keys([], 4) == [] and page_keys([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="page_size"):
        page_keys(toks, 0)


def test_admit_with_prefix_shares_and_allocates():
    state = prefix_state(idle=(1,))
    state = shadow_append(state, 0, BASES[0][:9], 0)
    low = np.full(MAX_PAGES, -1, np.int32)
    low[:2] = np.asarray(state.page_table[0, :2])
    fixed = np.asarray(state.high_table[0, :2]).copy()
    fixed[1] = -1                                                     # share fixed page 0 only
    new = jax.jit(admit_with_prefix)(state, 1, low, fixed, 8)
    assert int(new.error) == 0 and int(new.kv_lens[1]) == 8 and bool(new.active[1])
    np.testing.assert_array_equal(np.asarray(new.page_table[1]), low)
    h = np.asarray(new.high_table[1])
    assert h[0] == fixed[0] and len(set(h.tolist()) - {fixed[0]}) == 3 and fixed[0] not in h[1:]
    assert int(new.alloc.refcount[low[0]]) == 2 and int(new.high_alloc.refcount[fixed[0]]) == 2
    assert int(new.high_alloc.num_free) == int(state.high_alloc.num_free) - 3
    again = admit_with_prefix(new, 1, low, fixed, 8)                  # slot already active
    assert int(again.error) & ERR_BAD_SLOT
    np.testing.assert_array_equal(np.asarray(again.alloc.refcount), np.asarray(new.alloc.refcount))
    tight = prefix_state(num_high_pages=5, idle=(1,))                # 4 of 5 high pages used
    oom = admit_with_prefix(tight, 1, np.full(MAX_PAGES, -1, np.int32), np.full(2, -1, np.int32), 0)
    assert int(oom.error) & ERR_HIGH_OOM and not bool(oom.active[1])
    assert int(oom.high_alloc.num_free) == 1


@pytest.mark.parametrize("length", [0, 1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE + 3, 5 * PAGE])
def test_fork_reads_like_source_and_diverges(length):
    pc, shadow = new_cache(num_pages=18), new_shadow()
    toks = BASES[0][:length]
    pc.admit(0, toks, count_stats=False)
    cache_append(pc, 0, toks, 0)
    pc.fork(0, 1)
    st_ = pc.state
    n_full = length // PAGE
    row0, row1 = np.asarray(st_.page_table[0]), np.asarray(st_.page_table[1])
    np.testing.assert_array_equal(row1[:n_full], row0[:n_full])              # full pages shared
    if length % PAGE:
        assert row1[n_full] >= 0 and row1[n_full] != row0[n_full]            # partial page copied
    h0, h1 = np.asarray(st_.high_table[0]), np.asarray(st_.high_table[1])
    shared = min(n_full, CFG.num_fixed_pages)
    np.testing.assert_array_equal(h1[:shared], h0[:shared])
    assert not set(h1[shared:].tolist()) & set(h0.tolist())                  # ring never shared
    extra = [7, 1, 4, 2, 2][: MAX_TOKENS - length]
    cache_append(pc, 1, extra, length)                                       # dst diverges
    cache_append(pc, 0, [3] * len(extra), length)                            # src too
    shadow = admit(admit(shadow, 0), 1)
    shadow = shadow_append(shadow, 0, toks + [3] * len(extra), 0)
    shadow = shadow_append(shadow, 1, toks + extra, 0)
    for a, b in zip(read_all(pc.state), read_all(shadow)):
        np.testing.assert_array_equal(np.asarray(a[:, :2]).view(np.uint16), np.asarray(b[:, :2]).view(np.uint16))


def test_match_leaves_window_to_recompute_and_admit_reads_exactly():
    pc, shadow = new_cache(num_pages=18), new_shadow()
    toks = BASES[0][:16]
    pc.admit(0, toks)
    cache_append(pc, 0, toks, 0)
    assert pc.commit(0, toks) == 4
    assert pc.commit(0, toks) == 0                                           # idempotent
    # 16 tokens, last_n = 3: at most floor(13 / 4) = 3 pages may be reused
    m, pages = pc.match_prefix(toks)
    assert m == 12 and pages == np.asarray(pc.state.page_table[0, :3]).tolist()
    assert pc.match_prefix(toks[:7])[0] == 4 and pc.match_prefix(toks[:6])[0] == 0
    assert pc.match_prefix(BASES[1][:16])[0] == 8                            # shares two pages with BASES[0]
    m = pc.admit(1, toks + [4, 4])
    assert m == 12
    with pytest.raises(ValueError, match="first append must reach length 15"):
        cache_append(pc, 1, [toks[12]], m)                                   # window would reach the shared part
    cache_append(pc, 1, (toks + [4, 4])[m:], m)
    shadow = shadow_append(admit(shadow, 1), 1, toks + [4, 4], 0)
    a, b = read_all(pc.state), read_all(shadow)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x[:, 1]).view(np.uint16), np.asarray(y[:, 1]).view(np.uint16))
    s = pc.stats()
    assert s["hit_tokens"] == 12 and s["query_tokens"] == 34 and s["pages_saved"] == 3
    assert pc.match_prefix(toks, )[0] == 12 and pc.stats()["query_tokens"] == 34   # match has no side effects
    with pytest.raises(ValueError, match="shared"):
        cache_append(pc, 1, [1], 3)                                          # write into a shared page
    with pytest.raises(ValueError, match="is active"):
        pc.admit(1, toks)
    with pytest.raises(ValueError, match="priority"):
        pc.commit(0, toks, priority=101)


def test_salt_isolates():
    pc = new_cache(num_pages=18)
    pc.salt = "a"
    toks = BASES[2][:16]
    pc.admit(0, toks)
    cache_append(pc, 0, toks, 0)
    pc.commit(0, toks)
    assert pc.match_prefix(toks)[0] == 12
    pc.salt = "b"
    assert pc.match_prefix(toks)[0] == 0


# ------------------------------------------------------------------------------------------------ state machine
TOKENS = st.builds(lambda base, cut, extra: (BASES[base][:cut] + extra)[:MAX_TOKENS],
                   st.integers(0, len(BASES) - 1), st.integers(0, MAX_TOKENS),
                   st.lists(st.integers(0, 9), max_size=6)).filter(lambda t: len(t) >= 1)
SLOT = st.integers(0, SLOTS - 1)


class _Fixed:
    """A stand-in for `st.data()` that always draws one value (to call a rule from another rule)."""

    def __init__(self, value):
        self.value = value

    def draw(self, strategy):
        return self.value


class PrefixMachine(RuleBasedStateMachine):
    """Cache with reuse vs a shadow built without reuse from the same token ids."""

    @initialize(host_capacity=st.sampled_from([None, 2]), seed=st.integers(0, 3))
    def setup(self, host_capacity, seed):
        self.pc = new_cache(host_capacity=host_capacity, seed=seed)
        self.shadow = new_shadow()
        self.tokens = {}                       # live slot -> token ids
        self.golden = {}                       # key -> bytes of its pages when first committed
        self.committed = []                    # token lists committed so far

    def _free_slot(self):
        return min(set(range(SLOTS)) - set(self.tokens))

    def _commit(self, slot, priority):
        self.committed.append(list(self.tokens[slot]))
        before = set(self.pc.index)
        self.pc.commit(slot, self.tokens[slot], priority)
        for key in set(self.pc.index) - before:
            e = self.pc.index[key]
            self.golden[key] = page_bytes(self.pc.state, e.low, e.high)

    # -------------------------------------------------------------- rules
    @precondition(lambda self: len(self.tokens) < SLOTS)
    @rule(tokens=TOKENS, then_commit=st.booleans())
    def admit_prompt(self, tokens, then_commit):
        tokens = tokens[:MAX_TOKENS]
        slot = self._free_slot()
        try:
            m = self.pc.admit(slot, tokens)
        except CacheCapacityError:
            return
        assert m % PAGE == 0 and m <= max(0, len(tokens) - CFG.last_n)
        try:
            cache_append(self.pc, slot, tokens[m:], m)
        except CacheCapacityError:
            self.pc.release(slot)
            return
        self.shadow = shadow_append(admit(self.shadow, slot), slot, tokens, 0)
        self.tokens[slot] = list(tokens)
        if then_commit:
            self._commit(slot, 35)

    @precondition(lambda self: self.committed and len(self.tokens) < SLOTS)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 9), max_size=5))
    def readmit_committed(self, data, extra):
        """A prompt extending a committed one: the likely cache hit (host-tier pages come back here)."""
        self.admit_prompt(data.draw(st.sampled_from(self.committed)) + extra, False)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 9), min_size=1, max_size=6))
    def append_tokens(self, data, extra):
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.tokens[slot])
        extra = extra[:MAX_TOKENS - n]
        if not extra:
            return
        try:
            cache_append(self.pc, slot, extra, n)
        except CacheCapacityError:
            return
        self.shadow = shadow_append(self.shadow, slot, extra, n)
        self.tokens[slot] += extra

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), priority=st.sampled_from([0, 35, 100]))
    def commit(self, data, priority):
        self._commit(data.draw(st.sampled_from(sorted(self.tokens))), priority)

    @rule(tokens=TOKENS)
    def match(self, tokens):
        m, pages = self.pc.match_prefix(tokens)
        keys = page_keys(tokens, PAGE)
        assert m % PAGE == 0 and len(pages) == m // PAGE <= self.pc.max_match_pages(len(tokens))
        for key, pid in zip(keys, pages):
            e = self.pc.index[key]
            assert pid == (-1 if e.on_host else e.low)
        if m // PAGE < self.pc.max_match_pages(len(tokens)):
            assert keys[m // PAGE] not in self.pc.index

    @precondition(lambda self: 0 < len(self.tokens) < SLOTS)
    @rule(data=st.data())
    def fork(self, data):
        src, dst = data.draw(st.sampled_from(sorted(self.tokens))), self._free_slot()
        try:
            self.pc.fork(src, dst)
        except CacheCapacityError:
            return
        self.shadow = shadow_append(admit(self.shadow, dst), dst, self.tokens[src], 0)
        self.tokens[dst] = list(self.tokens[src])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pc.release(slot)
        self.shadow = jmixedkv.release(self.shadow, slot)
        del self.tokens[slot]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num=st.integers(1, 8), extra=st.lists(st.integers(0, 9), max_size=5))
    def recycle(self, data, num, extra):
        """commit -> release -> evict -> re-admit: the offload round trip (pages come back from the host)."""
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[slot]
        self._commit(slot, 35)
        self.release(_Fixed(slot))
        self._evict(num)
        self.admit_prompt(tokens + extra, False)

    @rule(num=st.integers(0, 8))
    def evict(self, num):
        self._evict(num)

    def _evict(self, num):
        """Evict and check nothing a live sequence references moved to the host."""
        st_ = jax.device_get(self.pc.state)
        live = [st_.page_table[s] for s in self.tokens]
        live_low = set(np.concatenate(live).tolist()) if live else set()
        before = {k for k, e in self.pc.index.items() if not e.on_host}
        pages = {k: self.pc.index[k].low for k in before}
        moved = self.pc.evict(num)
        gone = [k for k in before if k not in self.pc.index or self.pc.index[k].on_host]
        assert len(gone) == moved <= num
        assert not {pages[k] for k in gone} & live_low

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def restore(self, data):
        try:
            self.pc.prefetch(data.draw(st.sampled_from(self.committed)))
        except CacheCapacityError:
            pass

    # -------------------------------------------------------------- invariants
    @invariant()
    def reads_match_cache_without_reuse(self):
        live = sorted(self.tokens)
        np.testing.assert_array_equal(np.asarray(self.pc.state.kv_lens)[live],
                                      [len(self.tokens[s]) for s in live])
        for a, b in zip(jax.device_get(read_all(self.pc.state)), jax.device_get(read_all(self.shadow))):
            np.testing.assert_array_equal(a[:, live].view(np.uint16), b[:, live].view(np.uint16))

    @invariant()
    def refcounts_balance(self):
        st_ = jax.device_get(self.pc.state)
        active = np.asarray(st_.active)
        assert sorted(np.flatnonzero(active).tolist()) == sorted(self.tokens)
        for table, alloc, attr in ((st_.page_table, st_.alloc, "low"), (st_.high_table, st_.high_alloc, "high")):
            table, refcount = np.asarray(table)[active], np.asarray(alloc.refcount)
            expect = np.zeros_like(refcount)
            np.add.at(expect, table[table >= 0], 1)
            for e in self.pc.index.values():
                if not e.on_host and getattr(e, attr) >= 0:
                    expect[getattr(e, attr)] += 1
            np.testing.assert_array_equal(refcount, expect)
            free = np.asarray(alloc.free)[:int(alloc.num_free)]
            assert len(set(free.tolist())) == len(free)                       # no page freed twice
            assert set(free.tolist()) == set(np.flatnonzero(refcount == 0).tolist())
            for row in table:                                                # no page twice in one sequence
                used = row[row >= 0]
                assert len(set(used.tolist())) == len(used)

    @invariant()
    def writable_pages_exclusive(self):
        st_ = jax.device_get(self.pc.state)
        ref_low, ref_high = st_.alloc.refcount, st_.high_alloc.refcount
        nf = CFG.num_fixed_pages
        for s, toks in self.tokens.items():
            n = len(toks)
            row, hrow = st_.page_table[s], st_.high_table[s]
            if n % PAGE:
                assert ref_low[row[n // PAGE]] == 1                          # partial last page: own copy
            for c, hp in enumerate(hrow):
                if c >= nf or (c + 1) * PAGE > n:                            # ring / unfinished fixed pages
                    assert ref_high[hp] == 1

    @invariant()
    def index_pages_byte_identical(self):
        for key, e in self.pc.index.items():
            if e.on_host:
                assert key in self.pc.host and e.low == -1
                assert host_bytes(self.pc.host.get(key)) == self.golden[key]
            else:
                assert e.low >= 0 and (e.high >= 0) == (e.j < CFG.num_fixed_pages)
                assert e.parent is None or not self.pc.index[e.parent].on_host
        device = [e for e in self.pc.index.values() if not e.on_host]
        for e, got in zip(device, pages_bytes(self.pc.state, device)):
            assert got == self.golden[e.key]
        assert len(self.pc.host) == sum(e.on_host for e in self.pc.index.values())
        cap = self.pc.host.capacity_pages
        assert cap is None or len(self.pc.host) <= cap


PrefixMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=25, deadline=None,
                                           suppress_health_check=list(HealthCheck))
TestPrefixMachine = PrefixMachine.TestCase
