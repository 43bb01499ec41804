"""PrefixCache: whole pages kept CACHED, found again by their tokens, revived; evictions drop their entries.

Every test runs on the three backends; the serving loop's use of it is in test_serving*.py.
"""

import doctest

import numpy as np

import pytest
import torch

import tpool
from conftest import CPU_BACKENDS
from tpool.errors import InvalidPage, UseAfterFree
from tpool.scheduling import HostMirror, PrefixCache, PrefixMatch, WouldNotFit, prefix_cache
from tpool.testing import no_host_sync

PS = 4


def _setup(backend, num_pages=16, rows=4, max_pages=8, capacity=None):
    pool = tpool.PagePool(num_pages, page_size=PS, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, rows, max_pages), free=num_pages, cached=0)
    return pool, m, PrefixCache(m, capacity)


def test_shared_prefix_counts_the_pages_an_insert_names(backend):
    """A row whose pages the cache names (inserted, not shared by anyone yet) may not be cut below them:
    shared_prefix says so, as the refusal does; without the insert it is 0."""
    pool, m, cache = _setup(backend)
    (row,) = m.admit([10])
    assert m.shared_prefix(row) == 0
    cache.insert(row, list(range(10)))                   # names the two whole pages
    assert m.shared_prefix(row) == 2 * PS
    with pytest.raises(ValueError, match="would drop pages"):
        m.truncate([row], [2 * PS - 1])
    m.truncate([row], [2 * PS])                          # at the named pages' end: runs
    pool.check()


def _serve(m, cache, tokens):
    """A request of ``tokens`` admitted (prefilled), then left: its pages named by the cache and CACHED."""
    (row,) = m.admit([len(tokens)])
    cache.insert(row, tokens)
    m.finish([row], cache=True)


def _pages(m, row, n):
    return m.table.block_table[row, :n].tolist()


def test_a_hit_revives_the_pages_of_the_request_that_left(backend):
    pool, m, cache = _setup(backend)
    (row,) = m.admit([10])
    first = _pages(m, row, 3)
    assert cache.insert(row, list(range(10))) == 2 and len(cache) == 2      # whole pages only
    m.finish([row], cache=True)
    hit = cache.match(list(range(10)) + [7])
    assert hit == PrefixMatch(hit.slots, 8, hit.eids) and len(hit.slots) == 2 == len(set(hit.eids))
    new = cache.revive(hit, max_len=16)
    assert _pages(m, new, 2) == first[:2] and int(m.table.seq_lens[new]) == 8
    assert pool.stats()["pages.revived"] == 2 and cache.hits == 1 and cache.hit_tokens == 8
    cache.check_invariants()
    pool.check()


def test_a_match_leaves_a_token_to_compute_and_stops_at_the_first_other_token(backend):
    pool, m, cache = _setup(backend)
    _serve(m, cache, list(range(12)))
    assert cache.match(list(range(12))).n_tokens == 8            # the last token's logits come next
    assert cache.match(list(range(13))).n_tokens == 12
    assert cache.match(list(range(12)), max_pages=1).n_tokens == 4
    assert cache.match([0, 1, 2, 3, 4, 5, 9, 7, 8, 9, 10, 11, 12]).n_tokens == 4   # page 1 differs
    assert not cache.match([1, 0, 2, 3, 4])                      # page 0 differs: nothing
    assert not cache.match(list(range(4)))


def test_a_prefix_computed_twice_names_the_copy_inserted_last(backend):
    """The second insert of a prefix computed apart makes no entry but re-points the entries to its own
    pages (the same K/V), which its row then holds named: counted in shared_prefix, as an insert's."""
    pool, m, cache = _setup(backend)
    (a,) = m.admit([8])
    (b,) = m.admit([8])                                          # the same 8 tokens, computed apart
    newer = _pages(m, b, 2)
    assert cache.insert(a, list(range(8))) == 2 and cache.insert(b, list(range(8))) == 0
    assert m.shared_prefix(b) == 8 and cache.inserted == 2
    with pytest.raises(ValueError, match="would drop pages"):
        m.truncate([b], [4])
    m.finish([a, b], cache=True)
    hit = cache.match(list(range(9)))
    assert _pages(m, cache.revive(hit), 2) == newer
    cache.check_invariants()
    pool.check()


def test_a_prefix_computed_apart_stays_matchable_while_one_copy_of_it_is_resident(backend):
    """Two requests with one system prompt prefilled in one step (no hit possible), inserted and finished
    together. The second's insert re-points the prompt's entries to its own pages, so the first's copy,
    older on the LRU and named by nothing now, is evicted first and drops only the first's own suffix
    entry: the prompt and the second's suffix stay matchable until the second's own pages go. (Before,
    the older copy stayed named: its eviction dropped every entry, the second's suffix too, while the
    second's copy of the prompt stayed CACHED, named by nothing, never matchable.)"""
    pool, m, cache = _setup(backend, num_pages=16)
    system = list(range(100, 108))                  # two pages
    a_toks, b_toks = system + [1, 2, 3, 4], system + [5, 6, 7, 8]
    a, b = m.admit([12, 12])                        # one step: neither can hit the other
    a_pages, b_pages = _pages(m, a, 3), _pages(m, b, 3)
    assert cache.insert(a, a_toks) == 3 and cache.insert(b, b_toks) == 1
    m.finish([a, b], cache=True)                    # a's pages released first: older on the LRU
    cache.check_invariants()
    assert [cache.slot_page[s].item() for s in cache.match(b_toks + [9]).slots] == b_pages
    assert sorted(cache.evict(3).tolist()) == sorted(a_pages)
    assert cache.sync() == 1 and len(cache) == 3    # a's suffix entry only
    cache.check_invariants()
    assert cache.match(system + [9]).n_tokens == 8 and cache.match(a_toks + [9]).n_tokens == 8
    assert cache.match(b_toks + [9]).n_tokens == 12
    # b's pages go last page first: its suffix, then the prompt's second page, then its first
    for page, entries, prompt_hit in zip(b_pages[::-1], (2, 1, 0), (8, 4, 0)):
        assert cache.evict(1).tolist() == [page]
        assert cache.sync() == 1 and len(cache) == entries
        assert cache.match(system + [9]).n_tokens == prompt_hit == cache.match(b_toks + [9]).n_tokens
        cache.check_invariants()
    assert pool.stats()["pages.cached.current"] == 0
    pool.check()


def _revived_while_a_duplicate_runs(backend):
    """A and B prefill one two-page prompt ``S`` in one step (neither can hit the other); A is inserted and
    left, and C revives A's pages. Returns ``(pool, m, cache, S, b, a_pages, b_pages, c)``, B still running."""
    pool, m, cache = _setup(backend)
    S = list(range(100, 108))                       # two pages
    a, b = m.admit([8, 8])
    a_pages, b_pages = _pages(m, a, 2), _pages(m, b, 2)
    assert cache.insert(a, S) == 2
    m.finish([a], cache=True)
    c = cache.revive(cache.match(S + [9]), max_len=16)
    return pool, m, cache, S, b, a_pages, b_pages, c


def test_a_duplicate_inserted_while_a_reviver_holds_the_first_copy_leaves_the_entries_on_it(backend):
    """A and B prefill one prompt apart (one step); A is inserted and left, C revives A's pages and keeps
    running, then B is inserted and left. B's insert leaves the entries C holds alone (C's own insert
    names them later), so B's copy, named by nothing, is what an eviction takes, and a new request still
    hits the prompt while C holds it. (Before, B's insert re-pointed them to B's copy: evicting it dropped
    them, and a request matched nothing though C held the prompt.)"""
    pool, m, cache, S, b, a_pages, b_pages, c = _revived_while_a_duplicate_runs(backend)
    assert _pages(m, c, 2) == a_pages
    with no_host_sync():
        assert cache.insert(b, S) == 0
    m.finish([b], cache=True)
    assert [cache.slot_page[s].item() for s in cache.match(S + [9]).slots] == a_pages
    cache.check_invariants()
    assert sorted(cache.evict(2).tolist()) == sorted(b_pages)   # the only CACHED pages: the duplicate
    assert cache.sync() == 0 and len(cache) == 2
    assert cache.match(S + [9]).n_tokens == 8       # C still holds the prompt: a hit
    m.decode([c], 4)
    assert cache.insert(c, S + [7, 7, 7, 7]) == 1
    m.finish([c], cache=True)
    assert [cache.slot_page[s].item() for s in cache.match(S + [9]).slots] == a_pages
    cache.check_invariants()
    pool.check()


def test_a_reviver_that_left_without_an_insert_holds_nothing(backend):
    """C revives A's copy and leaves (finish into the cache without an insert), and a new request takes C's
    row: C's hold is gone with it, so B's insert of the same prompt re-points the entries to B's copy, and
    A's, released earlier and named by nothing, is what an eviction takes. (Had the hold outlived C, the
    entries stayed on A's copy, evicted first, and dropped while B's copy was resident.)"""
    pool, m, cache, S, b, a_pages, b_pages, c = _revived_while_a_duplicate_runs(backend)
    m.finish([c], cache=True)
    assert m.admit([4]) == [c]                      # another request in C's row
    cache.insert(b, S)
    m.finish([b], cache=True)
    assert [cache.slot_page[s].item() for s in cache.match(S + [9]).slots] == b_pages
    assert sorted(cache.evict(2).tolist()) == sorted(a_pages)
    assert cache.sync() == 0 and cache.match(S + [9]).n_tokens == 8
    cache.check_invariants()
    pool.check()


@pytest.mark.parametrize("reviver_first", [True, False])
def test_a_reviver_and_a_duplicate_finished_in_one_call_keep_the_prompt_while_a_copy_is_resident(backend,
                                                                                                  reviver_first):
    """C revived A's copy of a prompt that B computed apart; B and C are inserted (in either order) and
    finished in one call. Whichever copy the entries name, the other is released first and named by
    nothing: evicting two pages takes it, and the prompt stays matchable. (C's own insert ends its hold:
    an insert after it re-points the entries, as for rows inserted and finished together.)"""
    pool, m, cache, S, b, a_pages, b_pages, c = _revived_while_a_duplicate_runs(backend)
    order = [c, b] if reviver_first else [b, c]
    for row in order:
        cache.insert(row, S)
    m.finish(order, cache=True)
    named = [cache.slot_page[s].item() for s in cache.match(S + [9]).slots]
    assert named == (b_pages if reviver_first else a_pages)
    assert sorted(cache.evict(2).tolist()) == sorted(a_pages if reviver_first else b_pages)
    assert cache.sync() == 0 and cache.match(S + [9]).n_tokens == 8
    cache.check_invariants()
    pool.check()


def test_a_row_on_the_entries_own_pages_reinserted_changes_nothing(backend):
    """A row that revived the entries, and one forked from it, inserted with the same tokens: every
    entry names the row's page already, so the device index stays as it was (an insert past them
    names only the new pages), and the rows count the pages as named from page 0."""
    pool, m, cache = _setup(backend)
    tokens = list(range(12))
    _serve(m, cache, tokens)
    hit = cache.match(tokens + [7])
    row = cache.revive(hit, max_len=16)
    child = m.fork(row, 12)                         # whole pages: the same three
    state = lambda: [t.tolist() for t in (cache.slot_page, cache.slot_gen, cache.page_slot)]
    before = state()
    with no_host_sync():
        assert cache.insert(row, tokens) == 0 and cache.insert(child, tokens) == 0
    assert state() == before and len(cache) == 3 and m.named[row] == 3 == m.named[child]
    cache.check_invariants()
    m.decode([row], 4)
    assert cache.insert(row, tokens + [1, 2, 3, 4]) == 1
    sp, sg, ps = state()
    assert [sp[s] for s in hit.slots] == [before[0][s] for s in hit.slots] == _pages(m, row, 3)
    assert [sg[s] for s in hit.slots] == [before[1][s] for s in hit.slots]
    new = cache.match(tokens + [1, 2, 3, 4, 0]).slots[3]
    assert sp[new] == _pages(m, row, 4)[3] and ps[sp[new]] == new
    assert [v for i, v in enumerate(ps) if i != sp[new]] == [v for i, v in enumerate(before[2]) if i != sp[new]]
    m.finish([row, child], cache=True)
    assert cache.match(tokens + [7]) == hit
    cache.check_invariants()
    pool.check()


def test_a_match_made_before_its_entries_were_re_pointed_revives_the_copy_named_now(backend):
    """A match of A's pages is made; then B, which computed the same prefix apart, is inserted, which
    re-points the entries to B's pages, and A's copy (named by nothing now) is evicted. The match stays
    good (the entries keep their slots and ids): its revive takes B's pages, which hold the same prefix,
    with the generations the entries took from them (accepted: no use_after_free)."""
    pool, m, cache = _setup(backend)
    S = list(range(8))
    holds = {}                                      # page -> the tokens from the prompt's start to its end

    def prefill(tokens):
        (row,) = m.admit([len(tokens)])
        for j, page in enumerate(_pages(m, row, len(tokens) // PS)):
            holds[page] = tuple(tokens[:(j + 1) * PS])
        return row

    a = prefill(S)
    assert cache.insert(a, S) == 2
    m.finish([a], cache=True)
    hit = cache.match(S + [9])
    b = prefill(S)                                  # admitted without the hit: computed apart
    a_pages, b_pages = [cache.slot_page[s].item() for s in hit.slots], _pages(m, b, 2)
    assert cache.insert(b, S) == 0
    m.finish([b], cache=True)
    assert sorted(cache.evict(2).tolist()) == sorted(a_pages)   # A's copy: released first, named by nothing
    assert cache.sync() == 0 and len(cache) == 2
    row = cache.revive(hit, max_len=16)
    assert _pages(m, row, 2) == b_pages and int(m.table.seq_lens[row]) == 8
    assert [holds[p] for p in _pages(m, row, 2)] == [tuple(S[:4]), tuple(S)]
    assert pool.stats()["pages.revived"] == 2 and cache.hits == 1
    pool.check()                                    # the generations were B's pages': accepted
    m.finish([row], cache=True)
    cache.check_invariants()


def test_an_entry_re_pointed_while_its_eviction_is_unread_lets_its_new_page_go_when_dropped(backend):
    """An eviction takes A's pages (their entries stay on the host until its drop); B, which computed the
    same prefix apart, is inserted before the drop, so its insert re-points those entries to B's pages.
    The drop must let B's pages go as well (the eviction forgot A's only): they end named by nothing,
    and a later insert of the same prefix names them anew."""
    pool, m, cache = _setup(backend)
    S = list(range(8))
    a, b = m.admit([8, 8])
    b_pages = _pages(m, b, 2)
    cache.insert(a, S)
    m.finish([a], cache=True)
    cache.evict(2)                                  # A's pages; their entries wait for the drop
    assert cache.insert(b, S) == 0                  # the entries, still on the host, name B's pages now
    assert min(cache.page_slot[p].item() for p in b_pages) >= 0
    assert cache.sync() == 2 and len(cache) == 0
    assert [cache.page_slot[p].item() for p in b_pages] == [-1, -1]
    cache.check_invariants()
    c = m.fork(b, 8)
    m.finish([b], cache=True)
    assert cache.insert(c, S) == 2                  # B's pages, named anew
    m.finish([c], cache=True)
    assert [cache.slot_page[s].item() for s in cache.match(S + [0]).slots] == b_pages
    cache.check_invariants()
    pool.check()


def test_an_entry_that_names_no_page_is_re_pointed_with_its_old_id_bounded(backend):
    """Entries made from a hand-edited row name page ids outside the pool (-1, num_pages + 3); a row that
    computed the same prefix apart re-points them: the old ids are aimed at page_slot's spare last entry
    (no index outside it, the spare keeps its -1), and the entries name the row's pages from then on."""
    pool, m, cache = _setup(backend)
    (row,) = m.admit([12])
    m.table.block_table[row, 1] = -1
    m.table.block_table[row, 2] = pool.num_pages + 3
    m.table.invalidate_csr()
    assert cache.insert(row, list(range(12))) == 3
    (other,) = m.admit([12])
    with no_host_sync():
        assert cache.insert(other, list(range(12))) == 0
    slots, pages = cache.match(list(range(13))).slots, _pages(m, other, 3)
    assert [cache.slot_page[s].item() for s in slots] == pages
    assert [cache.page_slot[p].item() for p in pages] == list(slots)
    assert cache.page_slot[-1].item() == -1 and sum(v >= 0 for v in cache.page_slot.tolist()) == 3
    m.finish([row, other], cache=True)              # the release skips the two ids (invalid_page)
    cache.check_invariants()
    with pytest.raises(InvalidPage):
        pool.check()
    new = cache.revive(cache.match(list(range(13))), max_len=16)
    assert _pages(m, new, 3) == pages and int(m.table.seq_lens[new]) == 12
    pool.check()


def test_two_requests_share_a_hit_and_leave_it_cached_again(backend):
    pool, m, cache = _setup(backend)
    _serve(m, cache, list(range(9)))
    hit = cache.match(list(range(9)))
    r1, r2 = cache.revive(hit), cache.revive(hit)
    assert _pages(m, r1, 2) == _pages(m, r2, 2)
    assert pool.state.refcount[m.table.block_table[r1, :2].long()].tolist() == [2, 2]
    m.finish([r1, r2], cache=True)
    cache.check_invariants()
    pool.check()
    s = pool.stats()
    assert s["pages.used.current"] == 0 and s["pages.cached.current"] == 3   # 2 named, the partial third not


def test_an_eviction_closes_lookups_until_its_slots_are_read_and_drops_what_it_took(backend):
    pool, m, cache = _setup(backend, num_pages=8)
    _serve(m, cache, list(range(8)))               # pages stamped first: evicted first
    _serve(m, cache, list(range(100, 108)))
    assert len(cache) == 4 and m.cached == 4
    evicted = cache.evict(2).tolist()
    assert cache.closed and not cache.match(list(range(9)))
    with pytest.raises(ValueError, match="eviction is not dropped yet"):
        cache.revive(PrefixMatch((0,), PS))
    slots = cache.unread().tolist()
    assert sorted(evicted) == sorted(_slot_pages(cache, slots))
    assert cache.drop(slots) == 2 and not cache.closed and len(cache) == 2
    assert not cache.match(list(range(9))) and cache.match(list(range(100, 109))).n_tokens == 8
    cache.check_invariants()
    pool.check()


def _slot_pages(cache, slots):
    return [cache.slot_page[s].item() for s in slots if s >= 0]


def test_sync_drops_the_evicted_entries_and_padding_names_nothing(backend):
    pool, m, cache = _setup(backend, num_pages=8)
    _serve(m, cache, list(range(6)))               # one page named, the partial second CACHED unnamed
    named = cache.match(list(range(6))).slots
    ev = cache.evict(8).tolist()                   # more than there are: -1 padded
    assert len(ev) == 8 and sorted(ev)[:6] == [-1] * 6 and min(sorted(ev)[6:]) >= 0
    slots = cache.unread().tolist()
    assert [s for s in slots if s >= 0] == list(named) and slots.count(-1) == 7
    assert cache.closed and cache.unread() is None            # handed out once, not dropped yet
    assert cache.drop(slots) == 1 and len(cache) == 0 and cache.dropped == 1 and not cache.closed
    cache.check_invariants()


def test_a_cache_made_under_inference_mode_works_outside_it(backend):
    """Engines build their caches under torch.inference_mode(); the cache's index tensors were then inference
    tensors, and the reference backend's insert and evict (in-place torch ops) failed outside that mode."""
    with torch.inference_mode():
        pool, m, cache = _setup(backend)
    _serve(m, cache, list(range(8)))
    assert cache.match(list(range(9))).n_tokens == 8
    cache.evict(16)
    assert cache.sync() == 2 and len(cache) == 0
    cache.check_invariants()
    assert not any(t.is_inference() for t in (cache.slot_page, cache.slot_gen, cache.page_slot))


def test_padding_reads_as_no_slot_whatever_the_spare_entry_holds(backend):
    """The evicted pages' padding (-1) is aimed at page_slot's spare last entry; it read that entry, so a
    hand-edited spare naming a live entry handed it out as evicted and drop forgot an entry whose page
    stayed (named by a slot that could be reused). Padding is -1 on the three backends."""
    pool, m, cache = _setup(backend, num_pages=8)
    _serve(m, cache, list(range(4)))
    _serve(m, cache, list(range(100, 104)))
    (kept,) = cache.match(list(range(100, 105))).slots
    pool.incref(cache.slot_page[kept:kept + 1])           # (around the mirror) its page USED: not evicted
    cache.page_slot[-1] = kept                            # hand-edited spare entry
    ev = cache.evict(8).tolist()
    slots = cache.unread().tolist()
    assert ev.count(-1) == 7 and slots.count(-1) == 7 and kept not in slots
    assert cache.drop(slots) == 1 and cache.match(list(range(100, 105))).slots == (kept,)
    assert cache.page_slot[-1].item() == -1
    cache.check_invariants()


def test_an_entry_is_dropped_with_the_entries_under_it(backend):
    """Once a chain's first page is evicted, its second entry goes too (it could never be reached,
    and its page, still held, would be named twice by a later insert of the same prefix); and keys
    name the entry before them by an id never reused, so the first's slot, reused for another
    prefix whose second page holds the same tokens, never leads to the old second page."""
    pool, m, cache = _setup(backend, num_pages=8)
    tokens = list(range(8))
    _serve(m, cache, tokens)
    s0, s1 = cache.match(tokens + [0]).slots
    p0, p1 = cache.slot_page[s0].item(), cache.slot_page[s1].item()
    pool.incref(torch.tensor([p1], dtype=torch.int32))   # (around the mirror) page 1 USED: evict takes page 0
    assert cache.evict(1).tolist() == [p0]
    cache.sync()
    pool.free(torch.tensor([p1], dtype=torch.int32), cache=True)   # CACHED again; its entry dropped with page 0's
    assert not cache.match(tokens + [0]) and len(cache) == 0 and cache.dropped == 2
    assert cache.page_slot[p1].item() == -1        # its page, still CACHED, named by nothing
    cache.check_invariants()
    other = [50, 51, 52, 53] + tokens[4:]          # another first page, then the dropped entry's tokens
    (row,) = m.admit([8])
    own = _pages(m, row, 2)
    assert cache.insert(row, other) == 2
    m.finish([row], cache=True)
    hit = cache.match(other + [0])
    assert set(hit.slots) == {s0, s1}              # the dropped entries' slots, reused ...
    assert [cache.slot_page[s].item() for s in hit.slots] == own   # ... for this request's own pages
    assert p1 not in own
    cache.check_invariants()


def test_a_prefix_computed_apart_and_forked_is_named_once(backend):
    """Y and P prefill the same prefix apart, C forks P. P is inserted first, then Y, whose insert
    re-points the prefix's entries to Y's pages; P's last page is keyed under them. Y is released
    first, so evicting Y's pages drops P's entry with them (C still holds its page), so when C
    leaves, its insert names P's pages once, and evicting everything leaves no entry behind."""
    pool, m, cache = _setup(backend, num_pages=16, max_pages=4)
    S, T = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]
    y, p = m.admit([8, 12])
    c = m.fork(p, 12)
    cache.insert(p, S + T)
    cache.insert(y, S)                             # the prefix's entries name Y's pages now
    m.finish([y], cache=True)
    m.finish([p], cache=True)
    assert len(cache) == 3
    cache.evict(2)                                 # Y's two pages, released first
    assert cache.sync() == 3 and len(cache) == 0   # and the entry under them, whose page C holds
    assert cache.insert(c, S + T) == 3
    m.finish([c], cache=True)
    cache.check_invariants()                       # (two entries naming one page would fail here)
    cache.evict(16)
    assert cache.sync() == 3 and len(cache) == 0
    cache.check_invariants()
    pool.check()


def test_forked_rows_finished_in_one_call_are_evicted_leaves_first(backend):
    """Two rows forked from one prompt, inserted and finished into the cache in ONE call: the shared
    head pages are queued after both tails, so evicting two pages takes the two tails (leaves) and
    keeps the prefix both hang from, with no CACHED page left that no entry names: as when the rows
    finish in two calls. (Queued at its first occurrence, the head went between the tails: the
    eviction dropped it with every entry under it and left b's tail cached, named by nothing.)"""
    results = []
    for one_call in (True, False):
        pool, m, cache = _setup(backend)
        prompt = list(range(2 * PS))
        (a,) = m.admit([2 * PS])
        b = m.fork(a, 2 * PS, 4 * PS)                  # shares a's two whole pages
        m.decode([a, b], PS)                           # a page of its own each: the tails
        ta, tb = prompt + [1] * PS, prompt + [2] * PS
        cache.insert(a, ta)
        cache.insert(b, tb)
        tails = [m.table.block_table[r, 2].item() for r in (a, b)]
        if one_call:
            m.finish([a, b], cache=True)
        else:
            m.finish([a], cache=True)
            m.finish([b], cache=True)
        out = cache.evict(2).tolist()
        assert cache.sync() == 2
        cached = int((pool.state.page_state == 2).sum())
        results.append((out, len(cache), cache.match(tb + [0]).n_tokens, cached - len(cache)))
        assert out == tails
        cache.check_invariants()
        pool.check()
    assert results[0] == results[1] == (tails, 2, 2 * PS, 0)


def test_a_match_made_before_a_drop_is_refused(backend):
    """A match kept across an eviction and a drop may name slots reused for other pages since."""
    pool, m, cache = _setup(backend, num_pages=8)
    _serve(m, cache, [1, 2, 3, 4])
    hit = cache.match([1, 2, 3, 4, 9])
    cache.evict(1)
    cache.sync()
    _serve(m, cache, [7, 7, 7, 7])                 # the freed slot names this page now
    with pytest.raises(ValueError, match="stale match"):
        cache.revive(hit, 8)
    assert not cache.match([1, 2, 3, 4, 9]) and len(cache) == 1


def test_a_hand_made_match_is_refused_before_anything_changes(backend):
    """A PrefixMatch not made by match(): its n_tokens not its pages' tokens, a slot outside the cache
    (negative ones included: a Python list would take them), or an entry id that is not the slot's."""
    pool, m, cache = _setup(backend, num_pages=8, capacity=4)
    _serve(m, cache, list(range(8)))
    hit = cache.match(list(range(9)))
    before = (m.table.seq_lens.tolist(), pool.stats(), m.free, m.cached, m.reserved)
    last = len(cache._eid) - 1
    cache._eid[last] = hit.eids[0]                 # a free slot whose id a forged match names
    for bad, why in [(PrefixMatch(hit.slots, 4, hit.eids), "tokens|whole pages|expected"),
                     (PrefixMatch(hit.slots, 12, hit.eids), "tokens|whole pages|expected"),
                     (PrefixMatch((hit.slots[0], -1), 8, (hit.eids[0], hit.eids[0])), "expected slots in"),
                     (PrefixMatch((hit.slots[0], 4), 8, (hit.eids[0], hit.eids[0])), "expected slots in"),
                     (PrefixMatch((hit.slots[0], last), 8, (hit.eids[0], hit.eids[0])), "stale"),
                     (PrefixMatch(hit.slots, 8, hit.eids[::-1]), "stale"),
                     (PrefixMatch(hit.slots, 8, hit.eids[:1]), "stale"),
                     (PrefixMatch(hit.slots[1:], 4, hit.eids[1:]), "chain of entries")]:  # the second page first
        with pytest.raises(ValueError, match=why):
            cache.revive(bad, 16)
    assert (m.table.seq_lens.tolist(), pool.stats(), m.free, m.cached, m.reserved) == before
    cache._eid[last] = 0
    cache.check_invariants()


def test_a_match_of_another_cache_is_refused(backend):
    """A cache made again on the same mirror hands out the same slots in the same order: with entry ids
    counted per cache, a match kept from the first one revived the second one's pages, which hold other
    tokens. Entry ids are drawn from one count now."""
    pool, m, old = _setup(backend)
    _serve(m, old, list(range(8)))
    hit = old.match(list(range(9)))
    old.detach()
    new = PrefixCache(m)
    _serve(m, new, [50 + i for i in range(8)])
    assert new.match([50 + i for i in range(9)]).slots == hit.slots      # the same slots, other tokens
    with pytest.raises(ValueError, match="made by another cache"):
        new.revive(hit, 16)


def test_drop_refuses_what_is_not_the_unread_values_before_anything_changes(backend):
    """``drop(cache.unread())`` (the tensor, not its values) failed half-way with a KeyError: an entry
    left the index without its slot going back, and check_invariants failed for good."""
    pool, m, cache = _setup(backend, num_pages=8)
    _serve(m, cache, list(range(8)))
    cache.evict(2)
    ev = cache.unread()
    for bad, why in [(ev, "got a tensor"), ([0.5], "host ints"), ([cache_size := len(cache._keys)], "slots in"),
                     ([-2], "slots in")]:
        with pytest.raises(ValueError, match=why):
            cache.drop(bad)
    assert cache.closed and len(cache) == 2 and cache_size > 0
    assert cache.drop([int(v) for v in ev.tolist()]) == 2 and not cache.closed
    cache.check_invariants()
    cache.evict(0)                                   # nothing evicted: match stays open, no read needed
    assert not cache.closed and cache.unread() is None


def test_a_drop_that_fails_on_the_device_changes_nothing_and_may_be_retried(backend, monkeypatch):
    """A device error inside drop (letting go of the pages under an evicted entry) left the host index
    without those entries and their slots nowhere: check_invariants failed for good. Now the index
    changes only after the device writes, so the same drop runs again."""
    pool, m, cache = _setup(backend, num_pages=8)
    tokens = list(range(8))
    _serve(m, cache, tokens)
    s0, s1 = cache.match(tokens + [0]).slots
    p1 = cache.slot_page[s1].item()
    pool.incref(torch.tensor([p1], dtype=torch.int32))   # page 1 USED: evict takes page 0, its entry under it
    cache.evict(1)
    slots = cache.unread().tolist()
    real = cache._let_go

    def fails(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(cache, "_let_go", fails)
    with pytest.raises(RuntimeError, match="device lost"):
        cache.drop(slots)
    assert len(cache) == 2 and cache.closed and cache.dropped == 0 and cache.page_slot[p1].item() == s1
    monkeypatch.setattr(cache, "_let_go", real)
    assert cache.drop(slots) == 2 and len(cache) == 0 and not cache.closed
    assert cache.page_slot[p1].item() == -1
    cache.check_invariants()
    assert sorted(cache._free) == list(range(len(cache._keys)))   # every slot back


def test_revives_of_several_lengths_each_hold_their_own_pages(backend):
    """On numba a revive gathers into buffers the cache keeps per length: a later revive (same or
    another length) must not change the rows revived before."""
    pool, m, cache = _setup(backend, num_pages=16, rows=6)
    a, b = list(range(12)), list(range(100, 108))
    _serve(m, cache, a)
    _serve(m, cache, b)
    rows = [cache.revive(cache.match(t + [0]), 16) for t in (a, b, a, b, a[:4] + [50])]
    pages = [_pages(m, r, 3) for r in rows]
    assert pages[0] == pages[2] and pages[1] == pages[3] and pages[0][:1] == pages[4][:1]
    assert len({*pages[0], *pages[1][:2]}) == 5 and m.table.seq_lens[rows].tolist() == [12, 8, 12, 8, 4]
    m.finish(rows, cache=True)
    cache.check_invariants()
    pool.check()


def test_evictions_stay_closed_until_every_unread_is_dropped(backend):
    pool, m, cache = _setup(backend, num_pages=8)
    _serve(m, cache, [1, 2, 3, 4])
    _serve(m, cache, [5, 6, 7, 8])
    with pytest.raises(ValueError, match="none is outstanding"):
        cache.drop([])
    cache.evict(1)
    first = cache.unread()                         # in flight: read at the next step ...
    cache.evict(1)                                 # ... while the next step evicts again
    assert cache.drop(first.tolist()) == 1 and cache.closed and not cache.match([5, 6, 7, 8, 0])
    assert cache.drop(cache.unread().tolist()) == 1 and not cache.closed and len(cache) == 0
    cache.check_invariants()


def test_two_entries_dropped_under_one_that_name_one_page_leave_it_named_by_nothing(backend):
    """An insert made while evictions are outstanding keys a page under an entry already evicted: the
    page of another entry under it, evicted by the later eviction and handed out again. Dropping the
    first eviction drops both (one page, two entries): the page must end up named by nothing."""
    pool = tpool.PagePool(6, page_size=2, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, 4, 4), free=6, cached=0)
    cache = PrefixCache(m)

    def serve(tokens):
        (row,) = m.admit([len(tokens)])
        cache.insert(row, tokens)
        m.finish([row], cache=True)
        return row

    x, y = m.admit([4, 2])
    cache.insert(x, [1, 1, 2, 2])                  # entry a, entry b under it
    cache.insert(y, [1, 1])                        # the same first page computed apart: a names y's now
    m.finish([y, x], cache=True)                   # y released first: a's page is the oldest
    b_old = cache.slot_page[cache.match([1, 1, 2, 2, 0]).slots[1]].item()
    serve([9, 9])
    cache.evict(1)                                 # a's page
    first = cache.unread()                         # in flight
    cache.evict(2)                                 # b's page and x's first, b still live on the host
    (row,) = m.admit([4])
    a_page, b_page = _pages(m, row, 2)
    assert cache.page_slot[b_page].item() == -1 and b_page == b_old
    cache.insert(row, [1, 1, 3, 3])                # a (stale) re-pointed to the row's page; b2 under it,
    assert cache.page_slot[a_page].item() >= 0     # naming b's old page
    assert cache.drop(first.tolist()) == 3         # a, and b and b2 under it
    assert cache.page_slot[b_page].item() == -1 == cache.page_slot[a_page].item()
    cache.drop(cache.unread().tolist())
    cache.check_invariants()
    m.finish([row], cache=True)
    pool.check()


def test_a_stale_entry_is_refused_on_the_device_by_its_generation(backend):
    """An eviction made around the cache (its slots never dropped), the page handed out again: the
    revive takes nothing, counts use_after_free, and leaves the page's new holder untouched."""
    pool, m, cache = _setup(backend, num_pages=4)
    _serve(m, cache, list(range(5)))               # page A named, page B (partial) CACHED
    hit = cache.match(list(range(5)))
    page = cache.slot_page[hit.slots[0]].item()
    m._evict(2)                                    # around the cache (evict() refuses): the entry stays
    (holder,) = m.admit([15], [16])                # every page, the named one among them
    assert page in _pages(m, holder, 4)
    row = cache.revive(hit, max_len=4)             # (no reservation: the pool has no FREE page)
    assert int(m.table.seq_lens[row]) == 0 and _pages(m, row, 1) == [-1]
    assert pool.state.refcount[page].item() == 1
    with pytest.raises(UseAfterFree):
        pool.check()


def test_a_row_a_refused_revive_left_empty_names_no_page_when_inserted(backend):
    """A broken contract (the entries' pages evicted behind the cache): the revive is refused on the device
    (the row empty there, the mirror counting the prefix), later steps put other tokens' pages at the row's
    start. Its insert (the device length short of the tokens named) re-points no known entry and names none
    of those pages: the next hit of the prefix is refused on the device again (use_after_free), and the new
    entries name page -1 (invalid_page). (Before, the known entries named the suffix's pages with fresh
    generations, and the next hit was accepted: wrong K/V served silently.)"""
    pool, m, cache = _setup(backend)
    prefix, suffix = list(range(100, 108)), list(range(200, 208))
    _serve(m, cache, prefix)
    hit = cache.match(prefix + [1])
    named = _slot_pages(cache, hit.slots)
    pool.evict(2)                                   # around the cache: the named pages FREE
    row = cache.revive(hit, max_len=32)
    assert int(m.table.seq_lens[row]) == 0
    with pytest.raises(UseAfterFree):
        pool.check()
    m.decode([row], 8)                              # the suffix, at the row's start on the device
    state = [t.clone() for t in (cache.slot_page, cache.slot_gen, cache.page_slot)]
    with no_host_sync():
        assert cache.insert(row, prefix + suffix) == 2
    after = (cache.slot_page, cache.slot_gen, cache.page_slot)
    assert torch.equal(after[2], state[2])
    known = torch.tensor(hit.slots)                 # the known entries as they were: stale generations (the
    assert [a[known].tolist() for a in after[:2]] == [b[known].tolist() for b in state[:2]]   # pages reused)
    assert after[1][known].tolist() != pool.generations(torch.tensor(named, dtype=torch.int32)).tolist()
    longer = cache.match(prefix + suffix + [5])
    new = torch.tensor(longer.slots[2:])            # the new entries name nothing
    assert longer.n_tokens == 16 and after[0][new].tolist() == after[1][new].tolist() == [-1, -1]
    m.finish([row], cache=True)
    pool.check()
    again = cache.revive(cache.match(prefix + [5]), max_len=32)
    assert int(m.table.seq_lens[again]) == 0 and _pages(m, again, 2) == [-1, -1]
    with pytest.raises(UseAfterFree):
        pool.check()
    m.finish([again], cache=True)
    third = cache.revive(longer, max_len=32)
    assert int(m.table.seq_lens[third]) == 0
    with pytest.raises((UseAfterFree, InvalidPage)) as e:
        pool.check()
    assert e.value.counts == {"use_after_free": 2, "invalid_page": 2}   # the known entries stale, the new page -1


def test_an_entry_hand_edited_to_name_another_page_of_its_generation_is_refused_on_the_device(backend):
    """A hand edit of ``slot_page`` that aims an entry at another page with the same generation (every page
    starts at 0) would pass the generation check and hand out that page's K/V, another prefix's. The page
    does not name the slot back (``page_slot``), so the revive gathers generation -1: refused on the device
    (the row empty, ``use_after_free`` raised by ``pool.check()``), the other page left CACHED as it was."""
    pool, m, cache = _setup(backend)
    _serve(m, cache, list(range(100, 110)))         # 2 pages named, the partial third CACHED and unnamed
    _serve(m, cache, list(range(200, 210)))
    hit = cache.match(list(range(100, 109)))
    other = cache.match(list(range(200, 209)))
    theirs = _slot_pages(cache, other.slots)
    assert hit.n_tokens == 8 and pool.generations(torch.tensor(theirs, dtype=torch.int32)).tolist() == [0, 0]
    cache.slot_page[hit.slots[1]] = theirs[1]       # a hand edit: the entry names the other prefix's page
    states = pool.state.page_state.clone()
    with no_host_sync():
        row = cache.revive(hit, max_len=16)
    assert int(m.table.seq_lens[row]) == 0 and _pages(m, row, 2) == [-1, -1]
    assert torch.equal(pool.state.page_state, states)
    with pytest.raises(UseAfterFree):
        pool.check()
    m.finish([row], cache=True)
    row = cache.revive(other, max_len=16)           # the page's own entry still revives it
    assert _pages(m, row, 2) == theirs
    pool.check()


def test_a_shorter_insert_of_a_row_a_refused_revive_left_empty_names_no_page_either(backend):
    """The same broken contract, the row then decoding 16 tokens: an insert of only the prefix and half the
    suffix (16 tokens) names no more than the row holds on the device, but the row is still short of its
    sure length by the refused prefix (helper-163): nothing is named, the next hit is refused again."""
    pool, m, cache = _setup(backend)
    prefix, suffix = list(range(100, 108)), list(range(200, 216))
    _serve(m, cache, prefix)
    hit = cache.match(prefix + [1])
    pool.evict(2)                                   # around the cache: the named pages FREE
    row = cache.revive(hit, max_len=32)
    with pytest.raises(UseAfterFree):
        pool.check()
    m.decode([row], 16)                             # the device holds 16 tokens: as many as the insert names
    assert int(m.table.seq_lens[row]) == 16 and m.length_bounds(row) == (24, 24)
    state = [t.clone() for t in (cache.slot_page, cache.slot_gen, cache.page_slot)]
    with no_host_sync():
        assert cache.insert(row, prefix + suffix[:8]) == 2
    known = torch.tensor(hit.slots)
    assert [t[known].tolist() for t in (cache.slot_page, cache.slot_gen)] == [t[known].tolist() for t in state[:2]]
    assert torch.equal(cache.page_slot, state[2])
    m.finish([row], cache=True)
    pool.check()
    again = cache.revive(cache.match(prefix + [5]), max_len=32)
    assert int(m.table.seq_lens[again]) == 0       # refused again: its generations are stale
    with pytest.raises(UseAfterFree):
        pool.check()


def test_a_hand_edited_row_makes_entries_that_name_nothing_and_are_refused(backend):
    """Page ids outside the pool in a row (a hand edit) become entries that name no page: no index
    outside page_slot, the spare entry stays -1, a revive of them is refused on the device
    (invalid_page), and dropping them under an evicted entry touches nothing else."""
    pool, m, cache = _setup(backend)
    (row,) = m.admit([12])
    good = _pages(m, row, 1)[0]
    m.table.block_table[row, 1] = -1
    m.table.block_table[row, 2] = pool.num_pages + 3
    m.table.invalidate_csr()
    with no_host_sync():
        assert cache.insert(row, list(range(12))) == 3
    assert cache.page_slot[-1].item() == -1 and cache.page_slot[good].item() >= 0
    assert sorted(v for v in cache.page_slot.tolist() if v >= 0) == [cache.page_slot[good].item()]
    m.finish([row], cache=True)                     # the release skips the two ids (invalid_page)
    with pytest.raises(InvalidPage):
        pool.check()
    hit = cache.match(list(range(13)))
    assert hit.n_tokens == 12
    new = cache.revive(hit, max_len=16)
    assert int(m.table.seq_lens[new]) == 0          # refused: the row stays empty
    with pytest.raises(InvalidPage):
        pool.check()
    m.finish([new], cache=True)                     # (it holds no page: the revive was refused)
    cache.evict(3)                                  # the good page: its entry and the two under it go
    assert cache.sync() == 3 and len(cache) == 0
    assert set(cache.page_slot.tolist()) == {-1}
    pool.check()


def test_insert_refuses_a_row_not_running_and_tokens_past_its_length(backend):
    pool, m, cache = _setup(backend)
    with pytest.raises(ValueError, match="expected a running row"):
        cache.insert(0, [1, 2, 3, 4])
    (row,) = m.admit([5])
    with pytest.raises(ValueError, match=r"at most the row's sure length \(5\) tokens, got 6"):
        cache.insert(row, list(range(6)))
    with pytest.raises(ValueError, match="expected a match of at least one page"):
        cache.revive(PrefixMatch())
    assert len(cache) == 0


def test_a_full_index_names_what_fits_and_stays_consistent(backend):
    pool, m, small = _setup(backend, capacity=1)
    (row,) = m.admit([12])
    assert small.insert(row, list(range(12))) == 1 and len(small) == 1
    m.finish([row], cache=True)
    assert small.match(list(range(13))).n_tokens == 4
    small.check_invariants()


def test_rows_whose_pages_the_cache_may_name_are_finished_with_cache_true_only(backend):
    """finish(cache=False) of a row the cache inserted, or one that revived, forked or was forked
    from, would free named pages FREE: the next admission takes them and the entry's revive is
    refused on the device (use_after_free). With the cache on the mirror it is refused before any
    work; a row that shares nothing and was not inserted finishes either way."""
    tokens = list(range(9))
    pool, m, cache = _setup(backend)
    (a,) = m.admit([9])
    cache.insert(a, tokens)
    (plain,) = m.admit([5])
    before = (m.free, m.cached, m.live.copy(), m.table.seq_lens.tolist())
    with pytest.raises(ValueError, match=rf"finish: rows \[{a}\] may hold pages the prefix cache"):
        m.finish([a, plain])
    assert (m.free, m.cached, m.live.tolist(), m.table.seq_lens.tolist()) == (*before[:2], before[2].tolist(),
                                                                           before[3])
    m.finish([a], cache=True)
    c = cache.revive(cache.match(tokens + [1]), max_len=16)
    d = m.fork(plain, 4)
    for row in (c, d, plain):
        with pytest.raises(ValueError, match="cache=False would free them FREE"):
            m.finish([row])
    (e,) = m.admit([3])
    m.finish([e])                                   # shares nothing, named by nothing
    m.finish([c, d, plain], cache=True)
    (x,) = m.admit([16])                            # takes the FREE pages
    row = cache.revive(cache.match(tokens + [1]), max_len=16)
    assert int(m.table.seq_lens[row]) == 8          # the named pages stayed CACHED, not handed to x
    pool.check()
    cache.check_invariants()


def test_a_row_inserted_while_running_keeps_its_named_pages_and_shares_them_once_revived(backend):
    """An insert before a row's end names pages it still holds: the row may not be cut into them (their
    K/V would no longer be what the entries say), and once a revive may have taken them they count
    as shared, so the row's release credits none of them and reconcile finds the mirror true (it
    raised MirrorError when the release credited three CACHED pages the revived row holds)."""
    tokens = list(range(12))
    pool, m, cache = _setup(backend)
    (a,) = m.admit([12], [16])
    assert cache.insert(a, tokens) == 3 and m.named[a] == 3
    with pytest.raises(ValueError, match=r"rows \[0\] would drop pages they may share or that the prefix cache"):
        m.truncate([a], [10])
    b = cache.revive(cache.match(tokens + [5]), max_len=16)
    assert int(m.table.seq_lens[b]) == 12 and m.shared[a] == 3
    m.decode([a, b], 1)
    m.finish([a], cache=True)
    m.reconcile(m.snapshot())
    assert m.cached == pool.stats()["pages.cached.current"] == 1
    m.finish([b], cache=True)
    m.reconcile(m.snapshot())
    assert (m.free, m.cached) == (pool.available(), 5) and not m.named.any()
    pool.check()
    cache.check_invariants()


def test_the_mirror_evicts_through_its_cache_and_a_detached_cache_refuses_work(backend):
    """With a cache on the mirror, mirror.evict is refused (the entries naming the evicted pages would
    stay); detach() takes the cache off (refused while an eviction is unread), after which the cache
    refuses every call and the mirror evicts and takes a new cache."""
    pool, m, cache = _setup(backend)
    tokens = list(range(13))
    _serve(m, cache, tokens)
    (row,) = m.admit([4])
    hit = cache.match(tokens + [1])
    with pytest.raises(ValueError, match=r"evict: this mirror has a PrefixCache.* call its evict\(k\)"):
        m.evict(1)
    # finish(cache=True) queued the row's last page first: the partial page 3 (no entry), then page 2
    assert m.cached == 4 and -1 not in cache.evict(2).tolist()
    with pytest.raises(ValueError, match="detach: an eviction is not dropped yet"):
        cache.detach()
    assert cache.sync() == 1                        # page 2's entry; the two before it stay
    cache.detach()
    assert m.prefix_cache is None
    for what, call in (("match", lambda: cache.match(tokens)), ("revive", lambda: cache.revive(hit)),
                       ("insert", lambda: cache.insert(row, [1, 2, 3, 4])), ("evict", lambda: cache.evict(1)),
                       ("detach", cache.detach), ("sync", cache.sync), ("unread", cache.unread),
                       ("drop", lambda: cache.drop([0])), ("check_invariants", cache.check_invariants)):
        with pytest.raises(ValueError, match=rf"{what}: this PrefixCache was detached"):
            call()
    assert -1 not in m.evict(2).tolist() and m.cached == 0
    m.finish([row])
    again = PrefixCache(m)
    assert m.prefix_cache is again
    pool.check()


def test_tokens_must_be_host_ints_not_tensors(backend):
    """A 0-d tensor hashes by identity: tensor tokens made entries no match could ever find. They are
    refused (a device tensor's values would need a host read); a numpy int array works as a list."""
    pool, m, cache = _setup(backend)
    (row,) = m.admit([12])
    t = torch.arange(12)
    for tokens in (t, list(t), [*range(3), t[3], *range(4, 12)], t.numpy().astype(np.float64)):
        for call in (lambda: cache.insert(row, tokens), lambda: cache.match(tokens)):
            with pytest.raises(ValueError, match="tokens"):
                call()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="tokens"):
        cache.insert(row, [*range(11), t[11]])     # its last page: refused before any entry is made
    assert len(cache) == 0 and cache.inserted == 0
    assert cache.insert(row, t.numpy()) == 3
    m.finish([row], cache=True)
    assert cache.match(list(range(13))).n_tokens == 12 and cache.match(np.arange(13)).n_tokens == 12
    cache.check_invariants()


def test_a_token_that_is_not_an_int_is_refused_before_any_entry_is_made(backend):
    """A token that failed to hash in an insert's second page (a numpy array) raised a TypeError after the
    first page had been named, over a slot whose page and generation were those of an entry dropped
    before: a match then revived that page, another prompt's K/V, with no error anywhere. Every token of
    the pages an insert names is taken as an int (numpy integers, a 0-d integer array) or refused first;
    a float (even 2.0, which matched 2: token ids are ints, as a float numpy array was refused already) or a
    string is refused as well."""
    pool, m, cache = _setup(backend)
    a, b = m.admit([4, 8])
    cache.insert(b, [1, 2, 3, 4, 5, 6, 7, 8])
    cache.insert(a, [1, 2, 3, 4])                  # the first entry names a's page (inserted last) ...
    m.finish([a, b], cache=True)                   # ... released first
    cache.evict(1)      # the oldest page (the first prompt's): both entries dropped, the second page CACHED
    assert cache.sync() == 2 and len(cache) == 0
    (row,) = m.admit([8])
    for bad, said in ((np.array([0, 1]), "numpy.ndarray array"), (2.5, "float 2.5"), (2.0, "float 2.0"),
                      ("x", "str 'x'"), ([3], "list"), (np.float64(1), "numpy.float64")):
        # (match: the pages it walks)
        for call in (lambda: cache.insert(row, [9, 9, 9, 9, bad, 0, 0, 0]), lambda: cache.match([bad] * 5)):
            with pytest.raises(ValueError, match=f"tokens as host ints .*got {said}"):
                call()
        assert len(cache) == 0 and cache.inserted == 2 and not cache.match([9, 9, 9, 9, 1])   # (2: the two served)
    cache.check_invariants()
    assert cache.insert(row, [9, 9, 9, 9, np.int64(0), np.array(0), 0, 0]) == 2   # integers of numpy: taken
    assert cache.match([9, 9, 9, 9, 0, 0, 0, 0, 1]).n_tokens == 8
    cache.check_invariants()


def test_insert_evict_and_revive_never_read_the_device(backend):
    pool, m, cache = _setup(backend)
    (row,) = m.admit([12])
    (other,) = m.admit([8])
    with no_host_sync(host_data=True):
        cache.insert(row, list(range(12)))
        m.finish([row], cache=True)
        hit = cache.match(list(range(13)))
        new = cache.revive(hit, count_cached=True)
        cache.evict(1)
        slots = cache.unread()
    assert cache.drop(slots.tolist()) == 0         # the partial page, named by nothing
    assert int(m.table.seq_lens[new]) == 12 and other != new
    cache.check_invariants()


def test_a_revive_counting_cached_pages_leaves_the_step_to_an_eviction(backend):
    """``count_cached``: a revive's reservation may come out of the CACHED pages; no step runs until
    ``evict(shortfall)`` made them FREE."""
    pool, m, cache = _setup(backend, num_pages=4, max_pages=4)
    _serve(m, cache, list(range(16)))              # every page CACHED, none FREE
    hit = cache.match(list(range(16)))             # 3 pages: the fourth (the last token's) to compute
    with pytest.raises(WouldNotFit):
        cache.revive(hit)
    row = cache.revive(hit, count_cached=True)
    assert m.unreserved < 0 and not m.fits([row], 1)
    with pytest.raises(WouldNotFit):
        m.decode([row], 1)
    need = m.shortfall(rows=[row], n=1)
    assert need == 1 == m.cached
    cache.evict(need)
    cache.sync()
    m.decode([row], 1)
    assert int(m.table.seq_lens[row]) == 13
    cache.check_invariants()
    pool.check()


def test_cached_pages_count_as_room_only_when_asked(backend):
    pool, m, cache = _setup(backend, num_pages=8, max_pages=8)
    _serve(m, cache, list(range(16)))              # 4 pages CACHED, 4 FREE
    assert (m.cached, m.free) == (4, 4)
    assert m.can_admit([20]) == 0 and m.can_admit([20], count_cached=True) == 1   # 6 pages with its reservation
    assert m.shortfall([20]) == 2 and m.shortfall([12]) == 0
    (row,) = m.admit([12], [20])                   # 3 pages and a reservation of 1: every FREE page
    assert m.preemption([row], [0], 8) == [row]    # 8 more tokens: one page past the reservation
    assert m.preemption([row], [0], 8, count_cached=True) == []
    assert m.shortfall(rows=[row], n=8) == 1
    with pytest.raises(ValueError, match="count_cached: expected a bool"):
        m.can_admit([4], count_cached=1)


class _Loop:
    """A random scheduler on a HostMirror with a PrefixCache, and the test's record of what each page
    holds: for every page, the tokens from its request's start to the page's end (what its K/V were
    computed from). Read from the device after each call: the test's reads, not the loop's."""

    def __init__(self, backend, seed, num_pages=24, rows=6, max_pages=6):
        import random
        self.rng = random.Random(seed)
        self.pool, self.m, self.cache = _setup(backend, num_pages=num_pages, rows=rows, max_pages=max_pages)
        self.cap = max_pages * PS
        self.tokens = {}                    # row -> its tokens in the pages
        self.holds = {}                     # page -> the tokens up to its end, when it was written
        self.bases = [[self.rng.randrange(1, 50) for _ in range(self.rng.randint(4, 14))] for _ in range(3)]
        self.revived = 0

    def note(self, row):
        """Record the pages of ``row``; a page already written must hold what it held."""
        toks, n = self.tokens[row], len(self.tokens[row])
        pages = self.m.table.block_table[row, :-(-n // PS)].tolist()
        for j, page in enumerate(pages):
            end = min((j + 1) * PS, n)
            want = tuple(toks[:end])
            got = self.holds.get(page)
            # a partial page only grows; a full one never changes (a shared page holds one prefix for all)
            assert got is None or want[:len(got)] == got, (page, got, want)
            self.holds[page] = want

    def admit(self):
        rng, m = self.rng, self.m
        tokens = list(rng.choice(self.bases)) + [rng.randrange(1, 50) for _ in range(rng.randint(1, 6))]
        max_len = min(len(tokens) + rng.randint(1, 6), self.cap)
        hit = self.cache.match(tokens)
        try:
            if hit:
                row = self.cache.revive(hit, max_len)
                pages = self.m.table.block_table[row, :len(hit.slots)].tolist()
                # the revived pages hold exactly the prefix they were found by
                assert [self.holds.get(p) for p in pages] == [tuple(tokens[:(j + 1) * PS])
                                                               for j in range(len(pages))]
                self.tokens[row] = tokens[:hit.n_tokens]
                self.revived += 1
                self.note(row)
                if m.fits([row], len(tokens) - hit.n_tokens):
                    m.decode([row], len(tokens) - hit.n_tokens)
                    self.tokens[row] = tokens
            else:
                (row,) = m.admit([len(tokens)], [max_len])
                self.tokens[row] = tokens
        except WouldNotFit:
            return
        self.note(row)

    def decode(self):
        rows = [r for r in self.tokens if len(self.tokens[r]) < int(self.m.limit[r])]
        if rows and self.m.fits(rows, 1):
            self.m.decode(rows, 1)
            for r in rows:
                self.tokens[r].append(self.rng.randrange(1, 50))
                self.note(r)

    def fork(self):
        if self.tokens:
            src = self.rng.choice(sorted(self.tokens))
            n = self.rng.randint(1, int(self.m.lo[src]))
            try:
                row = self.m.fork(src, n, min(n + self.rng.randint(1, 6), self.cap))
            except WouldNotFit:
                return
            self.tokens[row] = self.tokens[src][:n]
            self.note(row)

    def finish(self):
        if self.tokens:
            row = self.rng.choice(sorted(self.tokens))
            self.cache.insert(row, self.tokens.pop(row))
            self.m.finish([row], cache=True)

    def evict(self):
        if self.m.cached:
            evicted = self.cache.evict(self.rng.randint(1, self.m.cached)).tolist()
            for p in evicted:
                self.holds.pop(p, None)        # FREE: its next holder writes it anew

    def run(self, ops):
        for _ in range(ops):
            op = self.rng.choice([self.admit, self.admit, self.decode, self.decode, self.fork, self.finish,
                                  self.evict])
            op()
            if self.cache.closed and self.rng.random() < 0.7:
                self.cache.sync()
            if not self.cache.closed:
                self.cache.check_invariants()
            self.pool.check()
        self.cache.sync()
        self.cache.check_invariants()


@pytest.mark.parametrize("seed", range(40))   # (about 1 in 10 made a page named twice, before entries were
def test_random_loops_revive_only_pages_that_hold_their_prefix(backend, seed):   # dropped with those under them)
    """Random admissions (hits revived, misses prefilled), decodes, forks (parents and children
    leaving in either order), finishes into the cache and evictions, with the evicted slots read at
    once or later: every revived page holds the tokens it was found by, and the index, the device
    tensors and the pool agree after every call."""
    if backend == "triton" and seed >= 3:
        pytest.skip("interpreted Triton: three loops")
    loop = _Loop(backend, seed)
    loop.run(60 if backend == "triton" else 300)
    assert loop.revived > 0 and loop.cache.dropped > 0


def test_a_revive_does_not_count_its_own_pages_as_room(backend):
    """With ``count_cached``, the CACHED pages a revive takes are no room for its reservation."""
    pool, m, cache = _setup(backend, num_pages=4, max_pages=4)
    row, _ = m.admit([12, 4], [12, 4])             # every page, nothing reserved
    cache.insert(row, list(range(12)))
    m.finish([row], cache=True)                    # 3 pages CACHED, none FREE
    hit = cache.match(list(range(13)))
    assert hit.n_tokens == 12 and (m.cached, m.free) == (3, 0)
    with pytest.raises(WouldNotFit):               # its next token needs a page; only its own are CACHED
        cache.revive(hit, 16, count_cached=True)
    cache.revive(hit, 12, count_cached=True)       # max_len 12: nothing to reserve
    cache.check_invariants()


def test_a_fork_takes_its_copy_on_write_page_from_the_free_ones(backend):
    """The copy-on-write page a fork takes at once must be FREE: with ``count_cached`` a CACHED page
    is room for its reservation (evicted before the step), not for that page."""
    pool, m, cache = _setup(backend, num_pages=4, max_pages=4)
    a, b = m.admit([12, 4], [12, 4])               # every page, nothing reserved
    cache.insert(a, list(range(12)))
    m.finish([a, b], cache=True)                   # 4 pages CACHED, none FREE
    row = cache.revive(cache.match(list(range(13))), 12, count_cached=True)
    assert (m.cached, m.free) == (1, 0)
    with pytest.raises(WouldNotFit, match="0 free"):
        m.fork(row, 10, 12, count_cached=True)     # a partial page to copy
    m.fork(row, 8, 8, count_cached=True)           # whole pages, nothing to reserve: nothing taken
    cache.check_invariants()
    pool.check()


def test_docstring_example():
    globs = {"torch": torch, "PagePool": tpool.PagePool, "PageTable": tpool.PageTable, "HostMirror": HostMirror,
             "PrefixCache": PrefixCache}
    result = doctest.testmod(prefix_cache, extraglobs=globs, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5 and result.failed == 0


def test_the_numba_updates_refuse_rows_slots_and_sizes_outside_their_arrays():
    """The numba backend's compiled updates (tpool.scheduling._prefix) read the table and the pool
    through addresses: a row, page run or slot outside the arrays, or outputs of another length, are
    refused (-1) with nothing written; a page id outside the pool names nothing (as the torch code)."""
    from tpool.scheduling import _prefix as X
    bt = np.array([[3, 1, -1], [2, 9, 0]], dtype=np.int32)     # a table of 2 rows, 3 pages each; 9: outside
    gen = np.array([10, 11, 12, 13], dtype=np.int32)          # a pool of 4 pages
    sp, sg, ps = np.full(4, -1, np.int32), np.full(4, -1, np.int32), np.full(5, -1, np.int32)
    lens = np.array([12, 12], dtype=np.int32)                 # the rows' lengths: 3 pages of 4 tokens
    at, gat, sl = bt.ctypes.data, gen.ctypes.data, lens.ctypes.data
    i64 = lambda *v: np.array(v, dtype=np.int64)
    for row, slots in [(2, i64(0)), (-1, i64(0)), (0, i64(0, 1, 2, 3)), (0, i64(4)), (0, i64(-1))]:
        assert X.insert_pages(at, 2, 3, row, slots, gat, 4, sp, sg, ps, sl, 0, 0, 0) == -1
    assert X.insert_pages(at, 2, 3, 0, i64(0), gat, 4, sp, sg, ps[:4], sl, 0, 0, 0) == -1   # page_slot not [P + 1]
    assert X.insert_pages(at, 2, 3, 0, i64(3), gat, 4, sp, sg[:3], ps, sl, 0, 0, 0) == -1   # slot_gen short
    assert X.insert_pages(at, 2, 3, 0, i64(0), gat, 4, sp, sg, ps, sl, 0, 2, 0) == -1   # known past the slots
    assert X.insert_pages(at, 2, 3, 0, i64(0), gat, 4, sp, sg, ps, sl, 0, -1, 0) == -1
    assert (sp == -1).all() and (sg == -1).all() and (ps == -1).all()
    assert X.insert_pages(at, 2, 3, 1, i64(0, 1, 2), gat, 4, sp, sg, ps, sl, 12, 0, 0) == 0
    assert sp.tolist() == [2, 9, 0, -1] and sg.tolist() == [12, -1, 10, -1] and ps.tolist() == [2, -1, 0, -1, -1]
    ev, out = np.array([2, -1, 7, -5], dtype=np.int32), np.full(4, 5, np.int32)   # -5: would wrap to page 0
    assert X.forget_pages(ev.ctypes.data, 4, ps, out[:3]) == -1 and (out == 5).all()
    assert X.forget_pages(ev.ctypes.data, 4, ps, out) == 0
    assert out.tolist() == [0, -1, -1, -1] and ps.tolist() == [2, -1, -1, -1, -1]
    pages, gens = np.zeros(2, np.int32), np.zeros(2, np.int32)
    ps[:] = [2, -1, 0, -1, -1]                                # (the forget above cleared page 0's slot)
    assert X.gather_slots(i64(0, 4), sp, sg, ps, pages, gens) == -1
    assert X.gather_slots(i64(0), sp, sg, ps, pages, gens) == -1
    assert X.gather_slots(i64(0, 3), sp, sg[:3], ps, pages, gens) == -1         # slot_gen shorter than slot_page
    assert X.gather_slots(i64(0, 2), sp, sg, ps, pages[:1], gens) == -1         # pages shorter than the slots
    assert X.gather_slots(i64(0, 2), sp, sg, ps, pages, gens[:1]) == -1         # gens shorter than the slots
    assert X.gather_slots(i64(0, 2), sp, sg, ps[:0], pages, gens) == -1         # no spare entry
    assert (pages == 0).all() and X.gather_slots(i64(2, 0), sp, sg, ps, pages, gens) == 0
    assert pages.tolist() == [0, 2] and gens.tolist() == [10, 12]
    ps[0] = 1                                                 # page 0 names another slot: generation -1
    assert X.gather_slots(i64(2, 0, 1), sp, sg, ps, np.zeros(3, np.int32), gens := np.zeros(3, np.int32)) == 0
    assert gens.tolist() == [-1, 12, -1]                      # (slot 1 names page 9, outside: its spare entry)


def test_a_rebound_block_table_is_not_followed_on_the_numba_backend():
    """The numba updates read the table where the backend's kernels do (its descriptors, checked and
    held when the table was made): a ``block_table`` attribute rebound to another tensor (here a view
    of 32 bytes shaped [4, 8], helper-87's reproducer, which read past its storage) changes nothing."""
    pool = tpool.PagePool(16, page_size=4, device="cpu", backend="numba")
    table = tpool.PageTable(pool, 4, 8)
    m = HostMirror(table, free=16, cached=0)
    real = table.block_table
    table.block_table = torch.full((8,), -1, dtype=torch.int32).view(1, 8).expand(4, 8)
    cache = PrefixCache(m)
    m.admit([8])
    (row,) = m.admit([8])
    assert cache.insert(row, list(range(8))) == 2
    assert cache.slot_page[:2].tolist() == real[row, :2].tolist() != [-1, -1]
    table.block_table = real
    m.finish([0, row], cache=True)
    cache.check_invariants()


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton under its interpreter (TRITON_INTERPRET=1)")
def test_the_triton_updates_give_what_the_numba_ones_give_and_bound_every_index():
    """The triton backend's kernels (tpool.kernels.prefix_cache) on hand-made arrays write what the numba
    updates (tpool.scheduling._prefix) write: a hand-edited row's ids outside the pool (-1, P, P + 3, -5,
    2**31 - 1) name nothing (generation -1, the spare entry kept -1, nothing else written), a page named
    twice ends with the later slot (in one chunk and across chunks), a call outside the arrays writes
    nothing; an eviction's padding and ids outside the pool read as no slot and clear only the spare entry."""
    from tpool.kernels import prefix_cache as K
    from tpool.scheduling import _prefix as X
    P, C, big = 6, 90, 2**31 - 1
    gen = np.arange(10, 10 + P, dtype=np.int32)
    bt = np.full((2, 80), -1, dtype=np.int32)
    bt[0] = [(i * 5) % (P + 2) - 1 for i in range(80)]   # two chunks of lanes; each page many times, -1 and P
    bt[1, :9] = [3, -1, P, P + 3, -5, big, 3, 1, 0]
    start = (np.full(C, 77, np.int32), np.full(C, 77, np.int32), np.array([-1] * 5 + [88, -1], np.int32))
    i64 = lambda *v: np.array(v, dtype=np.int64)

    lens = np.array([320, 36], dtype=np.int32)             # the rows' lengths (row 1: 9 pages of 4 tokens)

    def both(row, slots, need=0, known=0, first=0):
        want, got = [a.copy() for a in start], [torch.from_numpy(a.copy()) for a in start]
        X.insert_pages(bt.ctypes.data, 2, 80, row, slots, gen.ctypes.data, P, *want, lens.ctypes.data, need, known,
                       first)
        K.insert_pages_triton(torch.from_numpy(bt), row, torch.from_numpy(slots), torch.from_numpy(gen), *got,
                              torch.from_numpy(lens), need, known, first)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        return got

    for row, slots in [(2, i64(0)), (-1, i64(0)), (0, np.arange(81)), (0, i64(C)), (0, i64(-1))]:
        assert [g.tolist() for g in both(row, slots)] == [a.tolist() for a in start]
    for known in (-1, 2):                                   # known outside [0, n]: a call outside the arrays
        assert [g.tolist() for g in both(1, i64(0), 4, known)] == [a.tolist() for a in start]
    for first, slots in [(-1, i64(0)), (3, np.arange(78)), (80, i64(0))]:   # pages first.. outside the row
        assert [g.tolist() for g in both(0, slots, first=first)] == [a.tolist() for a in start]
    sp, sg, ps = both(1, i64(7, 0, 5), first=6)             # pages 6.. of row 1 (3, 1, 0), none before them
    assert sp[i64(7, 0, 5)].tolist() == [3, 1, 0] and sg[i64(7, 0, 5)].tolist() == [13, 11, 10]
    assert ps.tolist() == [5, 0, -1, 7, -1, 88, -1] and (np.delete(sp.numpy(), i64(7, 0, 5)) == 77).all()
    # a row shorter than the tokens named (37 > 36): the known slots (the first 3) kept, the others -1 and
    # -1, page_slot (its slot 88 of the spare entry too) unwritten; 36 tokens: every page named
    sp, sg, ps = both(1, i64(7, 0, 5, 2, 6, 1, 4, 3, 8), 37, 3)
    assert (np.delete(sp.numpy(), [2, 6, 1, 4, 3, 8]) == 77).all() and (sp[i64(2, 6, 1, 4, 3, 8)] == -1).all()
    assert sg.tolist() == sp.tolist() and ps.tolist() == start[2].tolist()
    assert both(1, i64(7, 0, 5, 2, 6, 1, 4, 3, 8), 36, 3)[0][7].item() == 3
    both(0, np.arange(89, 9, -1))
    slots = i64(7, 0, 5, 2, 6, 1, 4, 3)
    sp, sg, ps = both(1, slots)
    assert sp[slots].tolist() == [3, -1, P, P + 3, -5, big, 3, 1] and sg[slots].tolist() == [13] + [-1] * 5 + [13, 11]
    assert ps.tolist() == [-1, 3, -1, 4, -1, 88, -1] and (np.delete(sp.numpy(), slots) == 77).all()

    ev = np.array([3, -1, P, 1, -1, big, 3, -7, 5] + [-1] * 2100 + [1], dtype=np.int32)  # two chunks
    want_ps, want = ps.numpy().copy(), np.empty(ev.size, np.int32)
    assert X.forget_pages(ev.ctypes.data, ev.size, want_ps, want) == 0
    got = K.forget_pages_triton(torch.from_numpy(ev), ps)
    assert got.tolist() == want.tolist() == [4, -1, -1, 3, -1, -1, 4, -1, 88] + [-1] * 2100 + [3]
    assert ps.tolist() == want_ps.tolist() == [-1] * 7

    pages, gens = np.empty(3, np.int32), np.empty(3, np.int32)
    ps[3] = 7                                               # page 3 names slot 7 back (not slot 4)
    assert X.gather_slots(i64(7, 0, 4), sp.numpy(), sg.numpy(), ps.numpy(), pages, gens) == 0
    got = K.gather_slots_triton(torch.from_numpy(i64(7, 0, 4)), sp, sg, ps)
    assert [g.tolist() for g in got] == [pages.tolist(), gens.tolist()] == [[3, -1, 3], [13, -1, -1]]
    got = K.gather_slots_triton(torch.from_numpy(i64(C, -1, 1)), sp, sg, ps)   # (refused on the host before)
    assert [g.tolist() for g in got] == [[-1, -1, big], [-1, -1, -1]]


def test_the_numba_insert_lets_a_slots_old_page_go_only_where_it_still_names_the_slot():
    """A slot passed to insert_pages that named a page (a live entry, re-pointed to the row's copy): the
    old page is let go where page_slot still names that slot, before any slot is written; an old id
    outside the pool (-1, P, P + 3, -5, 2**31 - 1) is aimed at the spare entry (-5 must not wrap to
    page 2, which names slot 5), and a page another slot names keeps it."""
    from tpool.scheduling import _prefix as X
    P, big = 6, 2**31 - 1
    gen = np.arange(10, 10 + P, dtype=np.int32)
    bt = np.array([[3, -1, P + 3, 4, 5]], dtype=np.int32)
    sp = np.array([0, 1, -1, P, P + 3, -5, big, 4], dtype=np.int32)
    sg, ps = np.full(8, 77, np.int32), np.array([0, 5, 5, -1, 7, -1, -1], dtype=np.int32)
    slots = np.array([0, 1, 5, 7, 6], dtype=np.int64)
    lens = np.array([20], dtype=np.int32)
    assert X.insert_pages(bt.ctypes.data, 1, 5, 0, slots, gen.ctypes.data, P, sp, sg, ps, lens.ctypes.data, 20, 0,
                          0) == 0
    assert sp.tolist() == [3, -1, -1, P, P + 3, P + 3, 5, 4]
    assert sg.tolist() == [13, -1, 77, 77, 77, -1, 15, 14]
    assert ps.tolist() == [-1, 5, 5, 0, 7, 6, -1]   # page 0 let go by slot 0; page 4 kept by slot 7


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton under its interpreter (TRITON_INTERPRET=1)")
def test_the_triton_insert_lets_old_pages_go_as_the_numba_one_does():
    """Slots that named pages (ids in and outside the pool) re-pointed to a row's pages, over two chunks of
    lanes, from random states: the triton kernel writes what its numba twin writes."""
    from tpool.kernels import prefix_cache as K
    from tpool.scheduling import _prefix as X
    rng = np.random.default_rng(7)
    P, C, W = 12, 100, 80
    gen = np.arange(10, 10 + P, dtype=np.int32)
    odd = np.array([-1, P, P + 3, -5, 2**31 - 1, -(2**31)], dtype=np.int32)
    for trial in range(4):
        bt = rng.integers(-2, P + 2, size=(2, W)).astype(np.int32)
        sp = rng.integers(0, P, size=C).astype(np.int32)
        sp[rng.integers(0, C, size=12)] = odd[rng.integers(0, odd.size, size=12)]
        sg = np.full(C, 77, np.int32)
        ps = np.append(rng.integers(-1, C, size=P), -1).astype(np.int32)
        n = (W, 40, W - 3, 1)[trial]
        slots = rng.permutation(C)[:n].astype(np.int64)
        for s in slots[:6]:                          # pages that name the slot whose page they are
            if 0 <= sp[s] < P:
                ps[sp[s]] = s
        want = [a.copy() for a in (sp, sg, ps)]
        got = [torch.from_numpy(a.copy()) for a in (sp, sg, ps)]
        lens = np.full(2, W * PS, np.int32)
        assert X.insert_pages(bt.ctypes.data, 2, W, 1, slots, gen.ctypes.data, P, *want, lens.ctypes.data, W * PS,
                              0, 0) == 0
        K.insert_pages_triton(torch.from_numpy(bt), 1, torch.from_numpy(slots), torch.from_numpy(gen), *got,
                              torch.from_numpy(lens), W * PS, 0)
        assert [g.tolist() for g in got] == [w.tolist() for w in want], trial
        assert want[2][P] == -1


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton under its interpreter (TRITON_INTERPRET=1)")
def test_on_triton_insert_evict_and_revive_gather_in_one_launch_each(monkeypatch):
    from tpool.kernels import prefix_cache as K
    launches = []

    class Counted:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(K, name)

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    for name in ("insert_pages_kernel", "forget_pages_kernel", "gather_slots_kernel"):
        monkeypatch.setattr(K, name, Counted(name))
    pool, m, cache = _setup("triton")
    _serve(m, cache, list(range(12)))
    assert launches == ["insert_pages_kernel"]
    row = cache.revive(cache.match(list(range(13))))
    assert launches[1:] == ["gather_slots_kernel"]
    m.finish([row], cache=True)
    cache.evict(2)
    assert launches[2:] == ["forget_pages_kernel"]
    assert cache.sync() >= 2
    cache.check_invariants()


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton under its interpreter (TRITON_INTERPRET=1)")
def test_on_triton_a_changed_index_tensor_is_refused_before_a_launch():
    """The kernels take their bounds from the tensors' sizes (helper-90's reproducers): an attribute
    rebound to a shorter tensor is not followed (the kernels get the tensors the cache made), and one
    of those changed in place (``set_``) is refused, with nothing written past it and the index
    unchanged."""
    pool, m, cache = _setup("triton", num_pages=8)
    made = cache.page_slot
    buf = torch.full((16,), 77, dtype=torch.int32)
    cache.page_slot = buf[:8]                         # one entry short of num_pages + 1
    _serve(m, cache, list(range(8)))
    assert (buf == 77).all() and cache.page_slot is not made
    cache.page_slot = made
    cache.check_invariants()
    (row,) = m.admit([8])
    entries = len(cache)
    cache.slot_gen.set_(buf[:1])
    for call in (lambda: cache.insert(row, list(range(100, 108))), lambda: cache.evict(1),
                 lambda: cache.revive(cache.match(list(range(9))))):
        with pytest.raises(ValueError, match="slot_gen as it made it"):
            call()
    assert (buf == 77).all() and len(cache) == entries and m.cached == 2 and m.rows_free == 3


@pytest.mark.parametrize("name", ["slot_page", "slot_gen", "page_slot"])
def test_an_index_tensor_changed_in_place_is_refused_on_every_backend_before_anything_changes(backend, name):
    """Every backend's updates index the cache's three tensors, the torch code too (a drop's let-go on all
    three, every update on the reference backend): one changed in place (``set_`` to a shorter storage) is
    refused by insert, evict, revive and drop (``ValueError`` naming it), before the index, the mirror or
    the device changes, instead of an index out of range (an ``IndexError`` on a CPU, a device assert on
    CUDA) half-way through. An attribute rebound to another tensor is not followed, as on triton."""
    pool, m, cache = _setup(backend, num_pages=8)
    S = list(range(8))
    a, b = m.admit([8, 8])
    cache.insert(a, S)
    m.finish([a], cache=True)
    cache.evict(2)                                   # A's pages; their entries wait for the drop ...
    cache.insert(b, S)                               # ... re-pointed to B's: the drop lets B's go (torch code)
    t = getattr(cache, name)
    kept = t.view(-1)                                # (its storage, to set it back)
    buf = torch.full((16,), 77, dtype=torch.int32)
    t.set_(buf[:1])
    before = (len(cache), cache.closed, m.cached, m.free, m.rows_free, pool.state.counters.clone())
    for call in (lambda: cache.sync(), lambda: cache.insert(b, S), lambda: cache.evict(1)):
        with pytest.raises(ValueError, match=f"{name} as it made it"):
            call()
    assert (buf == 77).all()
    after = (len(cache), cache.closed, m.cached, m.free, m.rows_free, pool.state.counters.clone())
    assert before[:5] == after[:5] and torch.equal(before[5], after[5])
    t.set_(kept)                                     # (the tensor back)
    assert cache.sync() == 2 and len(cache) == 0
    cache.check_invariants()
    c = m.fork(b, 8)
    m.finish([b], cache=True)
    cache.insert(c, S)
    m.finish([c], cache=True)
    hit = cache.match(S + [0])
    t.set_(buf[:1])
    before = (m.rows_free, m.cached, m.free, pool.state.counters.clone())
    with pytest.raises(ValueError, match=f"{name} as it made it"):
        cache.revive(hit, 12)
    assert (buf == 77).all() and (m.rows_free, m.cached, m.free) == before[:3]
    assert torch.equal(pool.state.counters, before[3])
    t.set_(kept)
    made = getattr(cache, name)
    setattr(cache, name, buf[:1])                    # rebound: not followed
    row = cache.revive(hit, 12)
    assert int(m.table.seq_lens[row]) == 8 and (buf == 77).all()
    setattr(cache, name, made)
    cache.check_invariants()
    pool.check()


@pytest.mark.parametrize("name", ["slot_page", "slot_gen", "page_slot"])
def test_an_index_tensor_re_pointed_to_memory_of_the_same_size_is_refused_too(backend, name):
    """``set_`` to other memory of the same size passed the size check: on numba the compiled updates kept
    writing the memory the cache made (its numpy views), while check_invariants and a drop's let-go read
    and wrote the new memory through the tensor (two entries naming one page, a page_slot that disagrees).
    It is refused as a changed size is, before anything changes, on every backend; set back, it works."""
    pool, m, cache = _setup(backend, num_pages=8)
    S = list(range(8))
    (a,) = m.admit([8])
    t = getattr(cache, name)
    kept = t.view(-1)
    t.set_(t.clone())                                # the same size and contents, other memory
    before = (len(cache), m.free, m.cached, pool.state.counters.clone())
    for call in (lambda: cache.insert(a, S), lambda: cache.evict(1), cache.check_invariants):
        with pytest.raises(ValueError, match=f"{name} as it made it.*other memory"):
            call()
    assert (len(cache), m.free, m.cached) == before[:3] and torch.equal(pool.state.counters, before[3])
    t.set_(kept)
    assert cache.insert(a, S) == 2
    m.finish([a], cache=True)
    cache.check_invariants()
    assert cache.match(S + [0]).n_tokens == 8


@pytest.mark.parametrize("name", ["slot_page", "slot_gen", "page_slot"])
def test_drop_itself_refuses_an_index_tensor_changed_in_place(backend, name):
    """drop checks the tensors itself, not only through sync: the unread() values dropped by hand while a
    tensor is changed are refused (``ValueError`` naming it) before the host index or the device changes,
    and the same drop goes through once the tensor is set back. (Only sync's check was run by a test.)"""
    pool, m, cache = _setup(backend, num_pages=8)
    S = list(range(8))
    a, b = m.admit([8, 8])
    cache.insert(a, S)
    m.finish([a], cache=True)
    cache.evict(2)
    cache.insert(b, S)                               # re-pointed while unread: the drop lets B's pages go
    ev = cache.unread().tolist()
    t = getattr(cache, name)
    kept = t.view(-1)
    t.set_(torch.full((16,), 77, dtype=torch.int32)[:1])
    with pytest.raises(ValueError, match=f"{name} as it made it"):
        cache.drop(ev)
    assert len(cache) == 2 and cache.closed
    t.set_(kept)
    assert cache.drop(ev) == 2 and len(cache) == 0 and not cache.closed
    cache.check_invariants()
    pool.check()


# --- Pinned by helper-144's mutation run over tpool/scheduling (session 39) --------------------------------------

def test_insert_takes_at_most_the_rows_sure_length_after_a_rollback(backend):
    pool, m, cache = _setup(backend)
    (a,) = m.admit([8])
    m.decode([a], 4)                                 # 12 tokens
    m.rollback([a], torch.tensor([9], dtype=torch.int32), [9])
    assert m.length_bounds(a) == (9, 12)
    with pytest.raises(ValueError, match="sure length"):
        cache.insert(a, list(range(12)))
    assert len(cache) == 0
    assert cache.insert(a, list(range(9))) == 2


def test_an_insert_past_known_pages_names_every_page_up_to_its_last_entry(backend):
    pool, m, cache = _setup(backend)
    a, b = m.admit([8, 8])
    assert cache.insert(a, list(range(8))) == 2
    assert cache.insert(b, list(range(4)) + [9, 9, 9, 9]) == 1   # page 0 known (a's): only page 1 named
    assert m.shared_prefix(b) == 8
    with pytest.raises(ValueError, match="would drop pages"):
        m.truncate([b], [4])


def test_slots_dropped_while_another_eviction_is_unread_are_not_reused_before_it_is_dropped(backend):
    pool, m, cache = _setup(backend)
    x, y = m.admit([4, 8])
    assert cache.insert(y, list(range(8))) == 2       # parent entry, child entry under it
    cache.insert(x, list(range(4)))                   # parent entry (x's page now)
    m.finish([x], cache=True)                         # released first: evicted first
    m.finish([y], cache=True)
    cache.evict(1)
    u1 = cache.unread().tolist()                      # the parent's slot
    cache.evict(2)
    u2 = cache.unread().tolist()                      # the child's slot, outstanding
    assert cache.drop(u1) == 2                        # parent and the child under it
    (z,) = m.admit([4])
    assert cache.insert(z, [7, 7, 7, 7]) == 1         # a new entry while u2 is outstanding
    cache.drop(u2)
    assert len(cache) == 1
    assert cache.match([7, 7, 7, 7, 0]).n_tokens == 4
    cache.check_invariants()


def test_a_detached_caches_inserts_bind_no_row_under_the_next_cache(backend):
    pool, m, cache = _setup(backend)
    a, b = m.admit([8, 8])
    cache.insert(a, list(range(8)))
    cache.insert(b, list(range(4)) + [5, 5, 5, 5])
    cache.detach()
    PrefixCache(m)
    assert m.shared_prefix(a) == 0
    m.truncate([a], [2])
    m.finish([b])                                     # cache=False: its pages were named by no live cache
    assert m.free == pool.available()


def test_a_page_named_again_while_its_old_entry_waits_keeps_its_new_name(backend):
    """A child entry's page is evicted (its slot unread, the entry still live on the host), handed out
    again and named by a new entry; then the parent is evicted and its drop, read first, drops the
    child under it. The page must keep its new entry's name: a later eviction of it then hands out
    that entry's slot and the entry goes with it."""
    pool, m, cache = _setup(backend, num_pages=8)
    (x,) = m.admit([4])
    cache.insert(x, list(range(4)))                   # parent entry
    (y,) = m.admit([8])
    assert cache.insert(y, list(range(8))) == 1       # child entry, under the parent
    m.finish([y], cache=True)                         # released first: its pages are evicted first
    m.finish([x], cache=True)
    cache.evict(1)
    child = cache.unread().tolist()                   # the child's slot, outstanding
    (z,) = m.admit([4])
    page = m.table.block_table[z, 0].item()
    assert cache.insert(z, [7, 7, 7, 7]) == 1         # names the child's old page
    new_slot = cache.page_slot[page].item()
    assert new_slot >= 0 and [new_slot] != child
    m.finish([z], cache=True)
    cache.evict(2)
    assert cache.drop(cache.unread().tolist()) == 2   # the parent, and the child under it
    assert cache.page_slot[page].item() == new_slot
    assert cache.drop(child) == 0 and not cache.closed
    assert len(cache) == 1 and cache.match([7, 7, 7, 7, 0]).n_tokens == 4
    cache.check_invariants()
    cache.evict(1)
    assert cache.unread().tolist() == [new_slot]


def test_a_cache_refuses_what_is_not_a_mirror_a_match_or_tokens(backend):
    """Before, each of these raised AttributeError or TypeError, not a ValueError naming what was expected."""
    pool, m, cache = _setup(backend)
    (row,) = m.admit([10])
    cache.insert(row, list(range(10)))
    m.finish([row], cache=True)
    hit = cache.match(list(range(10)) + [7])
    (row,) = m.admit([10])
    bad = [(lambda: PrefixCache(m.table), "mirror: expected a HostMirror, got PageTable"),
           (lambda: cache.revive(hit.slots), r"revive: expected a PrefixMatch \(made by match\(\)\), got tuple"),
           (lambda: cache.revive(None), r"revive: expected a PrefixMatch \(made by match\(\)\), got NoneType"),
           (lambda: cache.match(12), "match: expected the tokens as host ints .* got int 12"),
           (lambda: cache.match({1, 2, 3, 4, 5}), "match: expected the tokens .* got set"),
           (lambda: cache.insert(row, dict.fromkeys(range(8))), "insert: expected the tokens .* got dict")]
    for call, match in bad:
        with no_host_sync(), pytest.raises(ValueError, match=match):
            call()
    assert len(cache) == 2 and m.rows_free == 3 and cache.revive(hit, 16) == 1 and m.lo[1] == 8
    cache.check_invariants()
