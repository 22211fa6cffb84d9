"""Host tier and eviction (`jmixedkv.offload` + `PrefixCache.evict / prefetch`): byte-identical page round trips
(NVFP4 data + scales, raw high rows, plain rows), priority-aware LRU leaf selection, host capacity, and that no
page a live sequence references is ever evicted."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import KVCacheConfig, init_state
from jmixedkv import offload
from jmixedkv.checks import CacheCapacityError
from jmixedkv.prefix import page_keys
from jmixedkv.state import admit

from helpers import (BASES, GROUPS, MAX_PAGES, PAGE, cache_append, host_bytes, new_cache, new_shadow, page_bytes,
                     read_all, shadow_append)

_gather = jax.jit(offload.gather_pages)
_scatter = jax.jit(offload.scatter_pages)


def _raw(payload):
    return [{k: np.asarray(v).view(np.uint8) for k, v in g.items()} for g in jax.device_get(payload)]


def _filled_state(dtype):
    cfg = KVCacheConfig(dtype, first_n=5, last_n=3, page_size=PAGE)
    state = init_state(cfg, GROUPS, 8, 2, MAX_PAGES, 8, poison=True, high_scale=0.5)
    state = admit(state, 0)
    return shadow_append(state, 0, BASES[1][:17], 0)


@pytest.mark.parametrize("dtype", ["mixed_nvfp4_bf16", "mixed_nvfp4_fp8"])
def test_gather_scatter_round_trip_is_byte_identical(dtype):
    state = _filled_state(dtype)
    low = np.asarray(state.page_table[0, :4])
    high = np.asarray(state.high_table[0, :4])
    src_low, src_high = jnp.asarray([low[0], low[3], -1, low[1]]), jnp.asarray([high[0], high[2], -1, -1])
    payload = _gather(state, src_low, src_high)
    assert set(payload[0]) == {"low_data", "low_scales", "high_rows"} and set(payload[1]) == {"plain_rows"}
    assert payload[0]["low_scales"].dtype == jnp.float8_e4m3fn
    assert payload[0]["high_rows"].dtype == state.config.high_dtype
    free_low, free_high = jnp.asarray([6, 7, 5, -1]), jnp.asarray([6, 7, -1, 5])
    moved = _scatter(state, free_low, free_high, payload)
    back = _raw(_gather(moved, free_low.at[3].set(low[1]), free_high.at[2].set(0).at[3].set(0)))
    want = _raw(payload)
    for g in range(2):
        for name in want[g]:
            cols = [0, 1, 3] if name != "high_rows" else [0, 1]
            np.testing.assert_array_equal(back[g][name][:, cols], want[g][name][:, cols])
    # pages that were not destinations are untouched (ids -1 skipped)
    for pool_new, pool_old in zip(jax.tree.leaves(moved.pools), jax.tree.leaves(state.pools)):
        a, b = np.asarray(pool_new).view(np.uint8), np.asarray(pool_old).view(np.uint8)
        if a.ndim > 2:
            np.testing.assert_array_equal(a[:, :5], b[:, :5])
    # host round trip (numpy) is byte-identical too
    pages = offload.payload_to_host(payload, 2, [True, True])
    assert pages[0].nbytes > 0 and all(a.flags.owndata for a in pages[0].groups[0].values())
    again = _raw(offload.host_to_payload(state, pages, 4))
    for g in range(2):
        for name in want[g]:
            np.testing.assert_array_equal(again[g][name][:, :2], want[g][name][:, :2])


def test_page_bucket():
    assert [offload.page_bucket(n) for n in (0, 1, 2, 3, 4, 5, 9)] == [1, 1, 2, 4, 4, 8, 16]


class _E:
    def __init__(self, name, priority, last_used, parent=None, live=False):
        self.name, self.priority, self.last_used, self.parent, self.live = name, priority, last_used, parent, live


def test_select_victims_priority_lru_and_leaves():
    a = _E("a", 35, 1)
    b = _E("b", 35, 2, parent=a)              # a's only child
    c = _E("c", 0, 9)                         # low priority, recently used
    d = _E("d", 100, 0)                       # high priority, oldest
    e = _E("e", 35, 0, live=True)             # held by a live sequence
    entries = [a, b, c, d, e]

    def is_leaf(x, picked):
        return all(id(ch) in picked for ch in entries if ch.parent is x)
    pick = offload.select_victims(entries, 10, is_leaf, lambda x: not x.live, lambda x: (x.priority, x.last_used))
    assert [x.name for x in pick] == ["c", "b", "a", "d"]       # priority, then LRU; parent only after child
    assert [x.name for x in offload.select_victims(entries, 2, is_leaf, lambda x: not x.live,
                                                   lambda x: (x.priority, x.last_used))] == ["c", "b"]
    assert offload.select_victims(entries, 0, is_leaf, lambda x: True, lambda x: 0) == []


def test_host_tier_validation():
    with pytest.raises(ValueError, match="capacity_pages"):
        offload.HostTier(-1)


def _prefill(pc, slot, toks, priority=35):
    m = pc.admit(slot, toks)
    cache_append(pc, slot, toks[m:], m)
    pc.commit(slot, toks, priority)
    return m


def test_evict_restore_round_trip_and_reads():
    pc, shadow = new_cache(num_pages=12, num_high_pages=12), new_shadow()
    toks = BASES[0][:16]
    _prefill(pc, 0, toks)
    golden = {k: page_bytes(pc.state, e.low, e.high) for k, e in pc.index.items()}
    assert pc.evict(8) == 0                                     # all held by the live sequence
    pc.release(0)
    free_before = pc.free_pages()
    assert pc.evict(8) == 4 and pc.stats()["host_entries"] == 4
    assert pc.free_pages() == (free_before[0] + 4, free_before[1] + 2)
    for k, e in pc.index.items():
        assert e.on_host and host_bytes(pc.host.get(k)) == golden[k]
    assert pc.match_prefix(toks) == (12, [-1, -1, -1])           # still matched, now on host
    m = pc.admit(1, toks + [4])                                  # restores 3 pages
    assert m == 12 and pc.stats()["restored_pages"] == 3
    cache_append(pc, 1, (toks + [4])[m:], m)
    for k, e in pc.index.items():
        if not e.on_host:
            assert page_bytes(pc.state, e.low, e.high) == golden[k]
    shadow = shadow_append(admit(shadow, 1), 1, toks + [4], 0)
    for a, b in zip(jax.device_get(read_all(pc.state)), jax.device_get(read_all(shadow))):
        np.testing.assert_array_equal(a[:, 1].view(np.uint16), b[:, 1].view(np.uint16))


def test_priority_decides_who_goes_first():
    pc = new_cache(num_pages=16, num_high_pages=16)
    _prefill(pc, 0, BASES[0][:8], priority=100)
    _prefill(pc, 1, BASES[2][:8], priority=0)
    pc.release(0)
    pc.release(1)
    assert pc.evict(1) == 1
    on_host = [e for e in pc.index.values() if e.on_host]
    assert len(on_host) == 1 and on_host[0].priority == 0 and on_host[0].j == 1   # the low-priority leaf
    assert pc.evict(1) == 1
    assert {(e.priority, e.j) for e in pc.index.values() if e.on_host} == {(0, 0), (0, 1)}


def test_pool_pressure_evicts_and_host_capacity_drops():
    pc = new_cache(num_pages=8, num_high_pages=12, host_capacity=1)
    _prefill(pc, 0, BASES[0][:16])                               # 4 committed pages
    pc.release(0)
    _prefill(pc, 0, BASES[2][:24])                               # needs 6 low pages, 4 free: evicts 2 leaves
    s = pc.stats()
    assert s["evicted_pages"] == 2 and s["host_entries"] == 1 and s["dropped_pages"] == 1
    assert len(pc.index) == s["device_entries"] + 1 == 2 + 6 + 1
    m, pages = pc.match_prefix(BASES[0][:16])                    # pages 0, 1 on device, 2 on host, 3 dropped
    assert m == 12 and pages[2] == -1 and min(pages[:2]) >= 0
    with pytest.raises(CacheCapacityError, match="nothing left to evict"):
        m = pc.admit(1, BASES[1][:24])
        assert m == 8                                            # BASES[1] shares two pages with BASES[0]
        cache_append(pc, 1, BASES[1][m:24], m)


def test_restore_keeps_the_matched_host_pages_when_its_evictions_overflow_the_host():
    """`admit` restores a matched prefix whose last page is on the host, and the eviction that frees room for it
    overflows a full host tier: the trim must drop another host page, not the one being restored (it dropped the
    restoring page's entry and `admit` failed with a KeyError; found by test_prefix's state machine)."""
    pc, shadow = new_cache(num_pages=8, num_high_pages=12, host_capacity=1), new_shadow()
    toks = BASES[0][:16]                                        # + 5 tokens: all 4 pages match
    _prefill(pc, 0, toks)                                       # 4 committed pages
    pc.release(0)
    assert pc.evict(1) == 1                                     # its last page -> the host (now full)
    golden = {k: page_bytes(pc.state, e.low, e.high) for k, e in pc.index.items() if not e.on_host}
    golden.update({k: host_bytes(pc.host.get(k)) for k in pc.host.keys()})
    _prefill(pc, 0, BASES[2][:20])                              # 5 more pages: the low pool is full
    pc.release(0)
    m = pc.admit(1, toks + [4] * 5)                                 # evicts one of BASES[2]'s pages to the host
    assert m == 16 and pc.stats()["restored_pages"] == 1 and pc.stats()["dropped_pages"] == 1
    assert len(pc.host) <= 1
    for k in page_keys(toks, PAGE):
        e = pc.index[k]
        assert not e.on_host and page_bytes(pc.state, e.low, e.high) == golden[k]
    cache_append(pc, 1, (toks + [4] * 5)[m:], m)
    shadow = shadow_append(admit(shadow, 1), 1, toks + [4] * 5, 0)
    for a, b in zip(jax.device_get(read_all(pc.state)), jax.device_get(read_all(shadow))):
        np.testing.assert_array_equal(a[:, 1].view(np.uint16), b[:, 1].view(np.uint16))


def test_zero_host_capacity_forgets():
    pc = new_cache(num_pages=12, num_high_pages=12, host_capacity=0)
    _prefill(pc, 0, BASES[0][:16])
    pc.release(0)
    assert pc.evict(10) == 4 and len(pc.index) == 0 and len(pc.host) == 0
    assert pc.match_prefix(BASES[0][:16])[0] == 0


def test_transitions_cross_lower_for_cuda():
    from jmixedkv.compat import cross_lower_cuda
    from jmixedkv.prefix import admit_with_prefix, copy_pages
    from jmixedkv.state import fork
    state = init_state(KVCacheConfig("mixed_nvfp4_bf16", first_n=5, last_n=3, page_size=PAGE), GROUPS, 8, 2,
                       MAX_PAGES, 8)
    ids = jnp.asarray([1, -1], jnp.int32)
    for fn, args in ((fork, (state, 0, 1)), (copy_pages, (state, ids, ids, ids, ids)),
                     (admit_with_prefix, (state, 0, jnp.full((MAX_PAGES,), -1, jnp.int32),
                                          jnp.full((2,), -1, jnp.int32), 0)),
                     (offload.scatter_pages, (state, ids, ids, offload.gather_pages(state, ids, ids)))):
        assert "func.func public @main" in cross_lower_cuda(fn, *args)


@pytest.mark.gpu
def test_gpu_offload_round_trip_and_fork_with_donation():
    """On the H200: round trip, pressure, fork and reuse admit with donated (in-place) transitions."""
    from jmixedkv.compat import on_gpu
    assert on_gpu(), "run with -m gpu on the GPU machine"
    test_evict_restore_round_trip_and_reads()
    test_pool_pressure_evicts_and_host_capacity_drops()
    from test_prefix import (test_fork_reads_like_source_and_diverges,
                             test_match_leaves_window_to_recompute_and_admit_reads_exactly)
    for length in (0, 1, PAGE + 1, 5 * PAGE):
        test_fork_reads_like_source_and_diverges(length)
    test_match_leaves_window_to_recompute_and_admit_reads_exactly()


def _select_by_rescan(candidates, num_pages, is_leaf, evictable, rank):
    """The definition, by brute force: rescan every candidate for leaves after each pick."""
    pool = [c for c in candidates if evictable(c)]
    picked, ids = [], set()
    while len(picked) < num_pages:
        leaves = [c for c in pool if id(c) not in ids and is_leaf(c, ids)]
        if not leaves:
            break
        best = min(leaves, key=rank)
        picked.append(best)
        ids.add(id(best))
    return picked


@pytest.mark.parametrize("seed", range(6))
def test_select_victims_heap_equals_rescan_on_random_forests(seed):
    """Random prefix forests (ties in rank, live entries, entries whose children are held): the heap with parent
    links and the generic path pick exactly what the brute-force rescan picks, in the same order."""
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(300):
        par = entries[int(rng.integers(len(entries)))] if entries and rng.random() < 0.8 else None
        entries.append(_E(i, int(rng.integers(3)) * 35, int(rng.integers(20)), parent=par,
                          live=bool(rng.random() < 0.1)))
    kids = {}
    for x in entries:
        if x.parent is not None:
            kids.setdefault(id(x.parent), []).append(x)

    def is_leaf(x, picked):
        return all(id(ch) in picked for ch in kids.get(id(x), ()))
    evictable, rank = (lambda x: not x.live), (lambda x: (x.priority, x.last_used))
    for k in (0, 1, 17, 300):
        want = _select_by_rescan(entries, k, is_leaf, evictable, rank)
        assert offload.select_victims(entries, k, is_leaf, evictable, rank, parent=lambda x: x.parent) == want
        assert offload.select_victims(entries, k, is_leaf, evictable, rank) == want
