"""check() says what went wrong and which argument to change, for every error kind.

Each test makes the mistake a user makes (through the public calls, on every CPU
backend), and checks the class, the counts and the advice in the message.
"""

import pytest

import tpool
from tpool.errors import HINTS, describe
from tpool.kernels import layout as L

from conftest import i32


def raised(pool, cls):
    with pytest.raises(cls) as e:
        pool.check()
    return e.value, str(e.value)


def test_every_kind_has_advice():
    assert set(HINTS) == set(L.ERROR_NAMES)
    text = describe({name: 1 for name in L.ERROR_NAMES.values()})
    assert len(text.splitlines()) == 1 + len(L.ERROR_NAMES)
    for name in L.ERROR_NAMES.values():
        assert f"  {name} (1): " in text


def test_alloc_larger_than_max_alloc_pages_names_the_arguments(make_pool, guard):
    pool = make_pool(65536)
    with guard():
        r = pool.alloc(i32([5000]))  # the default output holds min(num_pages, 4096) pages
    assert not r.ok[0]
    e, text = raised(pool, tpool.OutputOverflow)
    assert e.counts == {"out_overflow": 1}
    assert text.startswith("tpool: errors since the last check: out_overflow: 1\n")
    for advice in ("output buffer was too small", "max_alloc_pages", "default min(num_pages, 4096)",
                   "out=pool.alloc_out(max_pages=N)"):
        assert advice in text
    out = pool.alloc_out(max_pages=5000)  # the advice works
    with guard():
        r = pool.alloc(i32([5000]), out=out)
    assert r.ok[0]
    pool.check()


# Each call that can overflow an output, and the buffer check() must then name (one case each).
OVERFLOWS = {
    "alloc_pages": lambda pool, table: pool.alloc(i32([5]), out=pool.alloc_out(max_pages=4)),
    "slots": lambda pool, table: table.extend(i32([0, 1]), i32([3, 3]), max_tokens=4),
    "csr_indices": lambda pool, table: (table.extend(i32([0, 1]), i32([9, 9]), max_tokens=18),
                                        table.flashinfer_csr(i32([0, 1]), capacity=4)),
    "step_slots": lambda pool, table: table.step(i32([0, 1]), i32([3, 3]), max_tokens=4),
    "step_csr_indices": lambda pool, table: table.step(i32([0, 1]), i32([9, 9]), max_tokens=18, capacity=4),
}
ADVICE = {"alloc_pages": "out=pool.alloc_out(max_pages=N)", "slots": "max_tokens= the batch's total tokens",
          "csr_indices": "pass a larger capacity"}


@pytest.mark.parametrize("case", sorted(OVERFLOWS))
def test_out_overflow_names_the_one_buffer_that_overflowed(make_pool, guard, case):
    """The pool and its tables share one out_overflow count; each buffer counts again in a slot of
    its own, so check() gives the advice for that buffer only, and the exception's ``overflows``
    names it (stats() as overflows.<buffer>)."""
    buffer = case.removeprefix("step_")
    pool = make_pool(64, page_size=4)
    table = tpool.PageTable(pool, 2, 8)
    with guard():
        OVERFLOWS[case](pool, table)
    stats = pool.stats()
    assert {b: stats[f"overflows.{b}"] for b in ADVICE} == {b: int(b == buffer) for b in ADVICE}
    e, text = raised(pool, tpool.OutputOverflow)
    assert e.counts == {"out_overflow": 1} and e.overflows == {buffer: 1}
    unit = {"alloc_pages": "request", "slots": "lane", "csr_indices": "call"}[buffer]
    assert f"out_overflow (1): an output buffer was too small: {buffer} (1 {unit}): " in text
    assert "edited by hand" not in text
    for b, advice in ADVICE.items():
        assert (advice in text) == (b == buffer), (b, text)
    pool.check()  # the buffers' counts were read with the kind's: nothing left to raise


def test_out_overflow_of_two_buffers_names_both(make_pool, guard):
    pool = make_pool(64, page_size=4)
    table = tpool.PageTable(pool, 2, 8)
    with guard():
        OVERFLOWS["slots"](pool, table)
        OVERFLOWS["slots"](pool, table)
        OVERFLOWS["alloc_pages"](pool, table)
    e, text = raised(pool, tpool.OutputOverflow)
    assert e.counts == {"out_overflow": 3} and e.overflows == {"alloc_pages": 1, "slots": 2}
    assert ": alloc_pages (1 request): " in text and "; slots (2 lanes): " in text and "capacity" not in text


def test_out_overflow_counted_by_hand_lists_every_buffer():
    """A count no buffer claims (the counters edited by hand) gets the advice for all three."""
    pool = tpool.PagePool(16, backend="reference")
    pool.state.counters[L.ERR_OUT_OVERFLOW] += 1
    e, text = raised(pool, tpool.OutputOverflow)
    assert e.overflows == {} and "which one was not recorded (counters edited by hand?)" in text
    for advice in ADVICE.values():
        assert advice in text


def test_out_overflow_counts_that_do_not_add_up_say_so(guard):
    """Counts a hand edit added to out_overflow but to no buffer are not passed off as the buffer's."""
    pool = tpool.PagePool(16, backend="reference")
    pool.state.counters[L.ERR_OUT_OVERFLOW] += 2
    with guard():
        OVERFLOWS["alloc_pages"](pool, None)
    e, text = raised(pool, tpool.OutputOverflow)
    assert e.counts == {"out_overflow": 3} and e.overflows == {"alloc_pages": 1}
    assert "alloc_pages (1 request): " in text and "the buffers' counts add up to 1, not 3" in text


def test_prefill_without_max_tokens_says_pass_max_tokens(make_pool, guard):
    pool = make_pool(64, page_size=4)
    table = tpool.PageTable(pool, 2, 8)
    with guard():
        r = table.extend(i32([0]), i32([6]))  # 6 tokens, a 1-slot buffer (default: one per lane)
    assert not r.ok[0]
    _, text = raised(pool, tpool.OutputOverflow)
    assert "max_tokens" in text and "prefill" in text
    with guard():
        r = table.extend(i32([0]), i32([6]), max_tokens=6)
    assert r.ok[0]
    pool.check()


def test_csr_capacity_too_small_says_capacity(make_pool, guard):
    pool = make_pool(64, page_size=4)
    table = tpool.PageTable(pool, 2, 8)
    with guard():
        table.extend(i32([0, 1]), i32([9, 9]), max_tokens=18)  # 3 pages each
        table.flashinfer_csr(i32([0, 1]), capacity=4)
    _, text = raised(pool, tpool.OutputOverflow)
    assert "capacity" in text


def test_double_free_and_invalid_page_both_explained(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.free(i32([9, 0]))
    e, text = raised(pool, tpool.InvalidPage)  # the first kind in slot order picks the class
    assert e.counts == {"invalid_page": 1, "double_free": 1}
    assert "[0, num_pages)" in text and "Free each granted page once" in text


def test_use_after_free(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.incref(i32([2]))
    _, text = raised(pool, tpool.UseAfterFree)
    assert "FREE page" in text and "Keep a reference" in text


def test_negative_count(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.alloc(i32([-1]))
    _, text = raised(pool, tpool.InvalidCount)
    assert "negative count" in text and ">= 0" in text


def test_a_negative_count_in_a_table_call_fails_that_lane_only_and_says_so(make_pool, guard):
    """The hint said every later request failed, as in alloc: a scheduler trusting it would have
    requeued lanes that took their tokens."""
    pool = make_pool(16, page_size=2)
    table = tpool.PageTable(pool, 4, 4)
    with guard():
        res = table.extend(i32([0, 1, 2]), i32([-1, 3, 1]), max_tokens=4)
    assert res.ok.tolist() == [False, True, True] and table.seq_lens.tolist() == [0, 3, 1, 0]
    _, text = raised(pool, tpool.InvalidCount)
    assert "extend and step failed that lane only" in text and "other lanes took their tokens" in text


def test_bad_request_id(make_pool, guard):
    pool = make_pool(16, page_size=4)
    table = tpool.PageTable(pool, 2, 4)
    with guard():
        table.extend(i32([5]), i32([1]))
    _, text = raised(pool, tpool.InvalidRequest)
    assert "[0, max_requests)" in text and "larger max_requests" in text


def test_fork_of_a_freed_page_and_revive_into_a_busy_row_are_explained(make_pool, guard):
    """A fork meeting a page its source row names that was freed through the pool counts use_after_free,
    and a revive into a row that is not empty counts bad_request; the hints spoke of incref and touch,
    and of out-of-range or repeated ids and forks, only: a scheduler reading them looked in the wrong place."""
    pool = make_pool(16, page_size=4)
    table = tpool.PageTable(pool, 3, 4)
    with guard():
        table.extend(i32([0]), i32([8]), max_tokens=8)
    pool.free(table.block_table[0, :1].clone())        # a page the row still names, freed through the pool
    with guard():
        r = table.fork(i32([0]), i32([1]), i32([8]))
    assert not r.ok[0]
    e, text = raised(pool, tpool.UseAfterFree)
    assert e.counts == {"use_after_free": 1} and "fork met a page of its source row" in text
    assert "fork" in tpool.UseAfterFree.__doc__
    with guard():
        table.revive(0, i32([1]), 4)                     # row 0 is not empty
    e, text = raised(pool, tpool.InvalidRequest)
    assert e.counts == {"bad_request": 1} and "revive into a row that is not empty" in text
    assert "revive" in tpool.InvalidRequest.__doc__
    with guard():
        table.revive(2, i32([99]), 4)                    # a page id outside the pool
    _, text = raised(pool, tpool.InvalidPage)
    assert "revive" in text


def test_request_longer_than_its_row(make_pool, guard):
    pool = make_pool(16, page_size=4)
    table = tpool.PageTable(pool, 2, 2)
    with guard():
        r = table.extend(i32([0]), i32([9]), max_tokens=9)  # 3 pages, the row holds 2
    assert not r.ok[0]
    _, text = raised(pool, tpool.TableOverflow)
    assert "max_pages_per_request" in text and "ceil(longest sequence / page_size)" in text


def test_truncate_past_the_length(make_pool, guard):
    pool = make_pool(16, page_size=4)
    table = tpool.PageTable(pool, 2, 4)
    with guard():
        table.extend(i32([0]), i32([3]), max_tokens=3)
        table.truncate(i32([0]), i32([7]))
    _, text = raised(pool, tpool.InvalidLength)
    assert "0 <= length <=" in text
