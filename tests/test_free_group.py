"""Free groups: deferred frees that own their input (SGLang PR #34067 regression)."""

import pytest
import torch

from conftest import i32
from pool_model import PoolModel


def test_overwritten_view_frees_the_pages_that_were_passed(make_pool, guard):
    pool = make_pool(16)
    table = torch.full((2, 4), -1, dtype=torch.int32)
    with guard():
        r = pool.alloc(i32([4, 4, 1]))
    table.view(-1).copy_(r.pages[:8])
    row = table[0]                                # a view of the table row
    with pool.free_group():
        with guard():
            pool.free(row)
            table[0].copy_(table[1])              # the row is overwritten (rematch)
        assert pool.available() == 7              # still deferred
    with guard():
        with pool.free_group():
            pool.free(r.pages[8:9])               # the exit flush runs under the guard too
    assert pool.available() == 12
    state = pool.state.page_state.tolist()
    assert state[:4] == [0, 0, 0, 0]              # the original pages 0..3 are free
    assert state[4:8] == [1, 1, 1, 1]             # the ids written over the row are untouched
    pool.check()
    pool.check_invariants()


def test_group_keeps_the_cache_flag_and_applies_plain_then_cached(make_pool, guard):
    pool, model = make_pool(8), PoolModel(8)
    with guard():
        pool.alloc(i32([6]))
        with pool.free_group():
            pool.free(i32([0, 1]), cache=True)
            pool.free(i32([2]))
            pool.free(i32([3]), cache=True)
    model.alloc([6], 8)
    model.free([2])
    model.free([0, 1, 3], cache=True)
    model.assert_matches(pool)


def test_overflow_flushes_early_and_loses_nothing(make_pool, guard):
    pool = make_pool(32)
    with guard():
        r = pool.alloc(i32([20]))
        with pool.free_group(capacity=4) as group:
            pool.free(r.pages[0:3])
            pool.free(r.pages[3:6])      # 3 + 3 > 4: the first three are applied now
            assert group.flushes == 1
            pool.free(r.pages[6:16])     # larger than the buffer: applied at once
            assert group.flushes == 3
    assert group.flushes == 3            # nothing left at exit
    assert pool.available() == 28
    pool.check()
    pool.check_invariants()


def test_group_matches_ungrouped_frees_and_double_free_is_still_counted(make_pool, guard):
    pool = make_pool(8)
    with guard():
        pool.alloc(i32([3]))
        with pool.free_group():
            pool.free(i32([0]))
            pool.free(i32([0, 1]))
    assert pool.available() == 7
    assert pool.stats()["errors.double_free"] == 1


def test_an_incref_or_touch_in_a_group_sees_the_frees_before_it(make_pool, guard):
    """A group deferred the free past a later incref: the use after free passed uncounted and the page
    stayed in use. The group's frees are applied before an incref or touch, so it ends as without one."""
    import contextlib

    import tpool
    for call in ("incref", "touch"):
        ends = []
        for grouped in (False, True):
            pool = make_pool(8)
            with guard():
                p = pool.alloc(i32([1])).pages[:1].clone()
            with pool.free_group(capacity=4) if grouped else contextlib.nullcontext():
                with guard():
                    pool.free(p)
                    getattr(pool, call)(p)
            with pytest.raises(tpool.UseAfterFree):
                pool.check()
            ends.append((pool.available(), pool.state.page_state.tolist()))
            pool.check_invariants()
        assert ends[0] == ends[1] and ends[0][0] == 8


def test_a_revive_or_fork_in_a_group_sees_the_frees_before_it(make_pool, guard):
    """A table's revive and fork take references as incref does but did not flush the group: a prefix-cache
    entry dropped (its pages freed) and then revived in one group was revived, not refused, and a fork of a
    row whose pages were freed through the pool left two rows naming pages with one reference each, with no
    error counted. Grouped or not, both end the same now."""
    import contextlib

    import tpool
    for call in ("revive", "fork"):
        ends = []
        for grouped in (False, True):
            pool = make_pool(8, page_size=4)
            table = tpool.PageTable(pool, 3, 2)
            with guard():
                if call == "revive":
                    pages = pool.alloc(i32([2])).pages[:2].clone()
                else:
                    table.extend(i32([0]), i32([8]), max_tokens=8)
                    pages = table.block_table[0].clone()
            with pool.free_group(capacity=4) if grouped else contextlib.nullcontext():
                with guard():
                    pool.free(pages)
                    if call == "revive":
                        table.revive(1, pages, 8)
                    else:
                        table.fork(i32([0]), i32([1]), i32([8]))
            with pytest.raises(tpool.UseAfterFree):
                pool.check()
            ends.append((pool.available(), table.seq_lens.tolist(), pool.state.refcount.tolist()))
        assert ends[0] == ends[1], call
        if call == "revive":
            assert ends[0][1][1] == 0   # refused: the row stays empty


def test_a_truncate_or_cached_release_in_a_group_sees_the_frees_before_it(make_pool, guard):
    """A truncate reads reference counts (it refuses to end inside a shared page) and a release with
    cache decides CACHED or FREE by which call drops a page's last reference; neither flushed the
    group. A prefix cache's extra references dropped in a group made a rollback into such a page a
    bad_length (the request kept its rejected tokens), and a cached release of the row then left its
    pages FREE instead of CACHED. Grouped or not, all three calls end the same now."""
    import contextlib

    import tpool
    for call in ("truncate", "release", "step"):
        ends = []
        for grouped in (False, True):
            pool = make_pool(8, page_size=4)
            table = tpool.PageTable(pool, 3, 2)
            with guard():
                table.extend(i32([0]), i32([8]), max_tokens=8)   # request 0: pages 0, 1
                extra = table.block_table[0].clone()
                pool.incref(extra)                               # a prefix cache's references
            with pool.free_group(capacity=4) if grouped else contextlib.nullcontext():
                with guard():
                    pool.free(extra)                             # the cache lets go of them
                    if call == "truncate":
                        table.truncate(i32([0]), i32([6]))       # a rollback into page 1
                    elif call == "release":
                        table.release(i32([0]), cache=True)
                    else:
                        table.step(i32([-1]), i32([0]), release=i32([0]), release_cache=True)
            pool.check()                                         # no error, grouped or not
            ends.append((table.seq_lens.tolist(), pool.state.page_state.tolist(), pool.available()))
            pool.check_invariants()
        assert ends[0] == ends[1], call
        if call == "truncate":
            assert ends[0][0][0] == 6
        else:
            assert ends[0][1][:2] == [2, 2]                      # both pages CACHED


def test_a_flush_that_raises_at_exit_still_closes_the_group(make_pool, monkeypatch):
    """An exception inside the exit's flush (an interrupt, say) left the group open: every later free of the
    thread was deferred into a group nobody would exit, and no new group could open."""
    pool = make_pool(8)
    p = pool.alloc(i32([2])).pages[:2].clone()

    def interrupted(pages, cache):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt) as info:
        with pool.free_group(capacity=4):
            pool.free(p[:1])
            monkeypatch.setattr(pool, "_apply_free", interrupted)
        assert False, "not reached"
    monkeypatch.undo()
    assert pool._group is None
    assert any("1 buffered frees that may not have been applied" in n for n in info.value.__notes__)
    pool.free(p[1:])                   # applied at once, not deferred
    assert pool.available() == 7       # (p[0]: not applied, as the note says)
    with pool.free_group(capacity=4):  # a new group of the same buffer applies only its own frees
        pool.free(p[:1])
    assert pool.available() == 8
    pool.check_invariants()


def test_a_flush_on_the_other_side_of_a_capture_is_refused(make_pool, monkeypatch):
    """A fork (or revive, incref, touch) inside a CUDA graph capture flushed a group opened outside it: the
    captured free kernel ran only at replays, on whatever the buffer then held, and the frees queued were
    never applied. Simulated on a CPU pool: the check reads only the group's side and the capture state."""
    import tpool
    pool = make_pool(8, page_size=4)
    table = tpool.PageTable(pool, 3, 2)
    table.extend(i32([0]), i32([8]), max_tokens=8)
    p = pool.alloc(i32([1])).pages[:1].clone()
    with pool.free_group(capacity=4) as group:
        pool.free(p)
        group._cuda = True   # as on a CUDA pool, opened outside the capture
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="flush .*inside a CUDA graph capture the group was opened outside"):
            table.fork(i32([0]), i32([1]), i32([8]))
        for call, what in ((lambda: table.truncate(i32([0]), i32([4])), "truncate"),
                           (lambda: table.release(i32([0]), cache=True), "release with cache=True")):
            with pytest.raises(RuntimeError, match=f"flush .*{what}.* inside a CUDA graph capture"):
                call()                # (these flush too since session 44: the message names them)
        monkeypatch.undo()
        group._cuda = False
    assert pool.available() == 6 and table.seq_lens.tolist() == [8, 0, 0]   # the free applied at exit, no fork
    # A group closed inside the capture: its flush is refused, and the exit makes no device op (it would be
    # recorded into the graph, not run), closes the group and says what was not applied.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(func)
            return func(*args, **(kwargs or {}))
    ran = []
    group = pool.free_group(capacity=4)
    group.__enter__()
    pool.free(p)
    group._cuda = True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with Ops(), pytest.raises(RuntimeError, match="flush .*inside a CUDA graph capture") as info:
        group.__exit__(None, None, None)
    monkeypatch.undo()
    assert ran == [] and pool._group is None and pool.available() == 6
    assert any("1 buffered frees that may not have been applied" in n for n in info.value.__notes__)


def test_a_group_entered_inside_capture_keeps_its_own_buffer(make_pool, monkeypatch):
    """A graph that captured a free group rewrites that group's buffer at every replay (its ids, the free,
    then -1). Groups entered inside and outside capture shared the buffer of their capacity, so a replay
    issued while an eager group of that capacity held frees overwrote them with -1: the eager group's
    exit freed nothing, and its pages stayed USED with no error counted. Simulated on a CPU pool: the
    replay is the captured group's three device ops, rerun on the buffer they were recorded on."""
    pool = make_pool(8)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    group = pool.free_group(capacity=4)  # made outside the capture, entered inside (on a CUDA pool)
    group._cuda = True
    capturing[0] = True
    with group:
        pool.free(pool.alloc(i32([2])).pages[:2].clone())
    capturing[0] = False
    recorded = group.buffer
    mine = pool.alloc(i32([2])).pages[:2].clone()
    with pool.free_group(capacity=4) as eager:
        pool.free(mine)                       # held in the eager group's buffer until its exit
        theirs = pool.alloc(i32([2])).pages[:2].clone()
        recorded[0, :2].copy_(theirs)         # a replay: the copy, the flush's free, the reset
        pool._apply_free(recorded[0, :2], False)
        recorded[0, :2].fill_(-1)
    assert pool.available() == 8              # mine freed at the eager group's exit, theirs by the replay
    assert eager.buffer.data_ptr() != recorded.data_ptr()
    pool.check()
    pool.check_invariants()
    again = pool.free_group(capacity=4)       # a later group inside capture: the captured buffer again
    again._cuda = capturing[0] = True
    with again:
        pass
    assert again.buffer.data_ptr() == recorded.data_ptr() and len(pool._group_buffers) == 2


def test_preserved_is_refused_inside_an_open_group(make_pool):
    """Frees queued inside preserved survived its restore and were applied at the group's exit."""
    from tpool.graphs import preserved
    pool = make_pool(8)
    p = pool.alloc(i32([2])).pages[:2].clone()
    with pool.free_group(capacity=4):
        with pytest.raises(RuntimeError, match="a free group of this pool is open in this thread"):
            with preserved(pool):
                pool.free(p)
    assert pool.available() == 6
    with preserved(pool):   # outside the group: as before
        pool.free(p)
    assert pool.available() == 6


def test_groups_do_not_nest(make_pool):
    pool = make_pool(4)
    with pool.free_group():
        with pytest.raises(RuntimeError, match="do not nest"):
            with pool.free_group():
                pass


def test_group_buffer_is_pool_owned_and_reused(make_pool, guard):
    pool = make_pool(8)
    with guard():
        pool.alloc(i32([4]))
    with pool.free_group() as g1:
        with guard():
            pool.free(i32([0, 1]))
    with pool.free_group() as g2:
        with guard():
            pool.free(i32([2]), cache=True)
    assert g1.buffer.data_ptr() == g2.buffer.data_ptr()
    assert g2.buffer.eq(-1).all()                    # left clean for the next group
    assert pool.available() == 6 and pool.stats()["pages.cached.current"] == 1


def test_a_free_of_the_pool_state_is_refused_inside_a_group(make_pool):
    """An input sharing memory with the pool's state is refused (the kernel would read what it writes):
    numba's compiled free checks that, and inside a group the group's flush frees a copy instead, so
    numba accepted it there (ids 1, 0 of the free stack: live pages) while the others refused it."""
    pool = make_pool(8)
    pool.alloc(i32([2]))
    view = pool.state.free_stack[6:8]
    for _ in range(2):                            # the second time, as the input the last free checked
        with pool.free_group():
            with pytest.raises(ValueError, match="pages: shares memory with a buffer this call writes"):
                pool.free(view)
    assert pool.available() == 6
    with pool.free_group():
        pool.free(view.clone())
    assert pool.available() == 8
    pool.check()
    pool.check_invariants()


def test_a_group_closes_before_another_thread_opens_one_on_its_buffer(make_pool):
    """Groups of one capacity share the pool's buffer: a thread entering while another's group is
    still flushing at exit would write ids into the rows that flush reads and resets (frees lost,
    or applied twice). Thread A's flush is slowed down; thread B enters meanwhile and must wait."""
    import threading
    import time
    pool = make_pool(8)
    a_pages, b_pages = (pool.alloc(i32([2])).pages[:2].clone() for _ in range(2))
    real_free, a_flushing = pool.ops.free, threading.Event()

    def slow_free(pages, cache):
        if threading.current_thread().name == "A":
            a_flushing.set()
            time.sleep(0.2)
        real_free(pages, cache)
    pool.ops.free = slow_free

    def a():
        with pool.free_group(4):
            pool.free(a_pages)

    def b():
        assert a_flushing.wait(60)   # (a bound, not a timing: B must enter while A flushes)
        with pool.free_group(4):
            pool.free(b_pages)
    errors = []

    def run(target):   # a thread's failure is raised in the test's thread, not lost as a warning
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(f,), name=f.__name__.upper()) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.ops.free = real_free
    if errors:
        raise errors[0]
    pool.check()
    assert pool.available() == 8


def test_entering_while_another_threads_group_is_open_names_it(make_pool):
    import threading
    pool = make_pool(8)
    opened, done = threading.Event(), threading.Event()

    def hold():
        with pool.free_group(4):
            opened.set()
            done.wait()    # set by the test's thread in its finally: the group stays open until then
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert opened.wait(60)
        with pytest.raises(RuntimeError, match="another thread's free group is open"):
            with pool.free_group(4):
                pass
    finally:
        done.set()
        t.join()
    with pytest.raises(RuntimeError, match="free groups do not nest"):
        with pool.free_group(4):
            with pool.free_group(4):
                pass



# --- Pinned by helper-143's mutation run over the pool and page-table façade (session 39) ----------------------------

def test_free_group_default_capacity_is_4096(make_pool):
    """free_group() buffers 4096 ids by default, as documented."""
    pool = make_pool(8)
    group = pool.free_group()
    assert group.capacity == 4096 and tuple(group.buffer.shape) == (2, 4096)


def test_a_free_that_exactly_fills_the_group_does_not_flush_early(make_pool):
    """capacity 4, two frees of 2 ids: they fit, one pass at exit, none before
    (a free that exactly fills the buffer is buffered, not flushed early)."""
    pool = make_pool(8)
    r = pool.alloc(i32([4]))
    with pool.free_group(capacity=4) as group:
        pool.free(r.pages[:2].clone())
        pool.free(r.pages[2:4].clone())
        assert group.flushes == 0
    assert group.flushes == 1 and pool.available() == 8


def test_a_group_capacity_counts_plain_and_cached_ids_together(make_pool):
    """capacity 4: 3 plain ids then 3 cached ones do not fit together, so the plain ones are applied at the
    second free: the capacity counts both rows together."""
    pool = make_pool(8)
    r = pool.alloc(i32([6]))
    with pool.free_group(capacity=4) as group:
        pool.free(r.pages[:3].clone())
        pool.free(r.pages[3:6].clone(), cache=True)
        assert group.flushes == 1
    assert group.flushes == 2
    assert pool.available() == 5 and pool.stats()["pages.cached.current"] == 3
