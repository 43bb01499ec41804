"""Issue 11, kernel half: no stored value makes a kernel touch memory it was not given.

Each finding's smallest reproducer (``tests/safety_repro.py``) runs on every backend in a
subprocess, so a kernel that reads or writes past its tensors fails the test (nonzero
exit) instead of killing pytest; the outcomes must be the stated ones and equal on all
backends, bit for bit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CPU_BACKENDS, HAS_TRITON

HERE = Path(__file__).parent
INT32_MAX = 2**31 - 1
_runs = {}


def repro(backend: str) -> dict:
    """The reproducers' outcomes on ``backend`` (one subprocess per backend, cached)."""
    if backend not in _runs:
        env = dict(os.environ, TRITON_INTERPRET="1") if backend == "triton" else dict(os.environ)
        p = subprocess.run([sys.executable, str(HERE / "safety_repro.py"), backend], capture_output=True,
                           text=True, env=env, timeout=600)
        assert p.returncode == 0, f"{backend}: exit {p.returncode} (a negative code is a signal)\n{p.stderr[-3000:]}"
        _runs[backend] = json.loads(p.stdout.strip().splitlines()[-1])
    return _runs[backend]


@pytest.mark.parametrize("bad", [1_000_000, INT32_MAX])
def test_csr_of_a_length_past_the_row(backend, bad):
    """seq_lens[0] = 1e6 / INT32_MAX then flashinfer_csr: the lane is exported empty, counted once."""
    r = repro(backend)[f"csr_{bad}"]
    assert r["indptr"] == [0, 0, 1] and r["indices"] == [2] + [-1] * 7
    assert r["last"] == [4, 3] and r["corrupt"] == 1


@pytest.mark.parametrize("bad", [-6, -10**9])
def test_extend_of_a_negative_length(backend, bad):
    """seq_lens[1] = -6 / -1e9 then extend and step of request 1: the lane fails, no row changes."""
    r = repro(backend)[f"extend_{bad}"]
    assert r["ok"] == [False] and r["slots"] == [-1, -1, -1]
    assert r["rows"][0] == [0, 1, -1, -1] and r["rows"][1] == [2, -1, -1, -1]  # request 0's row untouched
    assert r["lens"][:2] == [6, bad] and r["step_ok"] == [False, True] and r["step_indptr"] == [0, 0, 2]
    assert r["corrupt"] == 2 and r["free"] == 13  # extend, the step's extend (its CSR counts no lane again)


def test_corrupt_free_count_and_stack_entry(backend):
    """A free count past the stack makes the pool look empty; a wild stack entry touches no page and is
    handed out as -1, never as the id outside the pool it holds."""
    r = repro(backend)["stack"]
    assert r["first_ok"] == [False]
    assert r["pages"] == [-1, 1, -1, -1] and r["corrupt"] == 2 and r["free"] == 2


def test_evict_with_a_wild_stamp(backend):
    """A CACHED page stamped outside [0, clock] by hand: eviction follows the LRU queue and does no
    arithmetic on stamps, so the pages go in the order they were cached and nothing is counted."""
    r = repro(backend)["stamp"]
    assert r["evicted"] == [0, 1] and r["corrupt"] == 0 and r["cached"] == 1


def test_a_free_of_a_page_with_a_refcount_near_int32_min(backend):
    """Session 25: Triton counted ``k - min(k, rc)`` in int32, which wrapped: double_free came out negative."""
    r = repro(backend)["free_wrapped_refcount"]
    assert r["double"] == 2 + 2**31 and r["rc"][0] == 0


def test_touch_of_a_page_in_no_known_state(backend):
    """Session 25: such a page is not stamped, and each entry naming it counts corrupt_state (as in incref)."""
    r = repro(backend)["touch_unknown"]
    assert r["corrupt"] == 2 and r["stamp"][1] == r["before"][1] and r["stamp"][0] == r["clock"]


def test_fork_from_a_row_holding_a_freed_page(backend):
    """Finding 4: the fork fails, dst stays empty, nothing is increffed; one use_after_free."""
    r = repro(backend)["fork"]
    assert r["ok"] == [False] and r["row"] == [-1] * 4 and r["lens"] == [2, 0, 0, 0]
    assert r["uaf"] == 1 and r["refcount"] == [0, 1]


def test_reference_counts_saturate(backend):
    """Finding 7: an incref past INT32_MAX saturates and counts; one free does not free the page."""
    r = repro(backend)["saturate"]
    assert r["refcount"] == INT32_MAX - 1 and r["state"] == 1 and r["overflow"] == 5 and r["free"] == 3
    r = repro(backend)["fork_saturate"]
    assert r["ok"] == [True, True] and r["refcount"][0] == INT32_MAX and r["overflow"] == 2


def test_free_count_near_int64_max(backend):
    """A free count whose sum with the pages freed wraps: no push (the release of a bound step, a
    free, an eviction), each refused page FREE unpushed and counted; the stack as it was."""
    r = repro(backend)["free_count_overflow"]
    stack = [7, 6, 5, 4, 3, 2, 1, 0]
    assert r["stack_after_release"] == r["stack_after_free"] == r["stack"] == stack
    assert r["evicted"] == [-1, -1] and r["free"] == 2**63 - 1
    # 2 pages of the release, 1 for the step's extend seeing the count, 2 of the free, 1 eviction
    assert r["corrupt"] == 6 and r["states"] == [0, 0, 0, 0, 2, 2, 0, 0]
    assert r["gens"] == [1, 1, 1, 1, 0, 0, 0, 0]  # FREE unpushed is FREE all the same; no eviction happened


def test_a_page_outside_the_pool_makes_no_slot(backend):
    """Row entries 10**6 and -7 (hand edits): the tokens on them get slot and position -1 and count
    corrupt_state, so no K/V write can be sent outside the cache; the rest of the step is as usual."""
    r = repro(backend)["bad_page_slots"]
    assert r["slots"][0] == [-1, -1] and r["pos"][0] == [-1, -1] and r["ok"][0] == [True, True]
    assert r["slots"][1] == [-1, 12] and r["pos"][1] == [-1, 4]  # row 1 moved on to a page of its own
    assert r["slots"][2] == [-1, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25] + [-1] * 5
    assert r["pos"][2] == [-1, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5] + [-1] * 5
    # both rows hold a wild id in every step: their CSR runs are empty, kv_lens 0 (then row 2's 6 tokens)
    assert r["indptr"] == [[0, 0, 0], [0, 0, 0], [0, 0, 2]] and r["kv_lens"] == [[0, 0], [0, 0], [0, 6]]
    # slots: 2, 1 and 1 per step; CSR: 2, 2 and 1 requests exported empty
    assert r["extend"] == [13, 14] and r["corrupt"] == 9


def test_a_page_outside_the_pool_never_reaches_the_csr(backend):
    """A request whose pages hold an id outside the pool is exported with no pages (kv_lens 0 in a
    step), one corrupt_state each: an attention kernel reading the CSR stays inside the cache. The
    steps take each way numba makes a step's CSR: runs kept and a row copied, a rebuild, growth in
    place (its new page from a wild free-stack entry)."""
    r = repro(backend)["bad_page_csr"]
    assert r["csr"] == dict(indptr=[0, 0, 1, 1], indices=[0, -1, -1, -1], last=[4, 3, 4], corrupt=1)
    first, kept, mended, grown = r["steps"]
    assert first["indptr"] == [0, 1, 2] and first["indices"] == [0, 1, -1, -1, -1] and first["corrupt"] == 1
    # row 2 names page 10**6: no slot (1), exported empty (1); row 0 kept its run and gained page 3
    assert kept["indptr"] == [0, 2, 2] and kept["indices"] == [0, 3, -1, -1, -1] and kept["last"] == [1, 4]
    assert kept["kv_lens"] == [5, 0] and kept["slots"] == [12, -1] and kept["corrupt"] == 3
    assert mended["indptr"] == [0, 2, 3] and mended["indices"] == [0, 3, 2, -1, -1] and mended["corrupt"] == 3
    # row 2 pops the wild entry: the pop (1), its slot (1), its request exported empty (1)
    assert grown["indptr"] == [0, 2, 2] and grown["indices"] == [0, 3, -1, -1, -1] and grown["last"] == [3, 4]
    assert grown["kv_lens"] == [7, 0] and grown["slots"] == [14, -1] and grown["corrupt"] == 6


def test_a_wild_page_is_not_grown_into_the_other_stepout(backend):
    """Two StepOuts taking turns: the step that pops a wild stack entry exports its request empty, and
    the other buffer's next step (numba: growth one step behind, in place) does not copy that page in."""
    turns = repro(backend)["bad_page_turns"]
    assert [t["indptr"] for t in turns] == [[0, 1, 2], [0, 1, 2], [0, 0, 2], [0, 0, 2]]
    assert turns[2]["indices"] == turns[3]["indices"] == [1, 3, -1, -1, -1]
    assert turns[3]["kv_lens"] == [0, 6] and turns[3]["corrupt"] == 5  # pop, slot, CSR; slot, CSR


def test_a_wild_page_past_the_capacity_is_counted(backend):
    """A wild id that would land past the CSR's capacity is still found (the request is exported empty,
    so the rest fits: no overflow); a row with both a wild id and a length past it counts once."""
    small, swapped, step, both = repro(backend)["bad_page_past_capacity"]
    assert small == dict(indptr=[0, 3, 3], indices=[0, 1, 2, -1], last=[2, 2], corrupt=1, overflow=0)
    assert swapped["indptr"] == [0, 2, 2] and swapped["indices"][:3] == [6, 7, -1] and swapped["corrupt"] == 2
    # the step: row 1's new token lands on the wild page (no slot, 1) and its request is exported empty (1)
    assert step == dict(indptr=[0, 2, 2], indices=[6, 7, -1], kv_lens=[4, 0], corrupt=4, overflow=0)
    assert both == dict(indptr=[0, 0, 3], indices=[0, 1, 2, -1], last=[2, 2], corrupt=5)


def test_a_fork_pairs_only_page_ids_of_the_pool(backend):
    """cow_src / cow_dst (what a consumer copies K/V between) are -1 unless both are page ids of the pool."""
    r = repro(backend)["fork_cow"]
    assert r["ok"] == [True, False, True] and r["src"] == [1, -1, -1] and r["dst"] == [4, -1, -1]
    assert r["corrupt"] == 2 and r["rows"] == [[0, 4], [-1, -1], [0, -1]]  # lane 2 pops the wild entry: -1


def test_state_and_buffers_re_pointed_by_hand_are_not_followed(backend):
    """A pool's or table's state tensor, a StepOut's buffer or its memo re-pointed (``set_``) at a
    smaller tensor: every backend keeps writing the memory it was given, as on an untouched twin
    (Triton wrote past the new tensor, with the pool's sizes; numba's revive followed the memo)."""
    r = repro(backend)["re_pointed"]
    assert r["canary_changed"] == 0
    assert r["same_as_untouched"] and r["free"] == 57 and r["rows"][:3] == [4, 5, -1]


def test_backends_carry_their_state_as_held_views(backend):
    """The contract's ``st`` / ``ts`` (what the prefix cache reads beside a table's kernels): on every
    backend, every state tensor of the pool's and the table's ops is a view of the façade's tensor's
    memory with its shape, and not the façade's tensor itself (which a hand edit can re-point)."""
    import tpool
    pool = tpool.PagePool(16, page_size=4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    for held, state in ((pool.ops.st, pool.state), (table.ops.st, pool.state), (table.ops.ts, table.state)):
        mine, theirs = held.tensors(), state.tensors()
        assert mine.keys() == theirs.keys() and getattr(held, "lock", None) is getattr(state, "lock", None)
        for name, t in theirs.items():
            h = mine[name]
            assert h is not t and (h.data_ptr(), h.shape, h.dtype) == (t.data_ptr(), t.shape, t.dtype), name


@pytest.mark.parametrize("owner", ["pool", "table"])
def test_check_invariants_names_a_state_tensor_re_pointed_by_hand(backend, owner):
    """A state tensor re-pointed by hand (``set_``, ``.data =``) is not what the calls run on: check_invariants
    raised a bare IndexError / RuntimeError (a smaller tensor), or checked memory no call uses (one of the same
    size). It raises InvariantViolation naming the tensor and both places, on the pool and on a table."""
    import torch
    import tpool
    pool = tpool.PagePool(16, page_size=4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    table.extend(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32))
    state, name = (pool.state, "page_state") if owner == "pool" else (table.state, "seq_lens")
    t = getattr(state, name)
    n = t.numel()
    for edit in ("smaller", "same size", "data"):
        kept = t.view(t.shape)
        if edit == "data":
            t.data = t.clone()
        else:
            t.set_(torch.zeros(n - 1 if edit == "smaller" else n, dtype=t.dtype))
        for check in (table.check_invariants,) + ((pool.check_invariants,) if owner == "pool" else ()):
            with pytest.raises(tpool.InvariantViolation,
                               match=rf"invariant broken: {'PagePool' if owner == 'pool' else 'PageTable'}'s state "
                                     rf"tensor '{name}' was re-pointed by hand \(set_ or .data =\): it is torch.int"
                                     rf"\d+ \(\d+,\) at 0x[0-9a-f]+ on cpu, its calls run on torch.int\d+ "
                                     rf"\({n},\)"):
                check()
        t.set_(kept)                                   # set back: checked again
        table.check_invariants()
        pool.check_invariants()


@pytest.mark.parametrize("owner, name, edit", [
    ("pool", "refcount", "fewer entries"),      # same address, dtype and strides; one entry fewer
    ("pool", "page_gen", "another dtype"),      # same address, shape and strides, read as uint32
    ("table", "block_table", "other strides"),  # same address, dtype and shape, read column-major
])
def test_check_invariants_names_a_state_tensor_re_pointed_at_its_own_address(backend, owner, name, edit):
    """Re-pointed by hand at the memory it starts at (the same ``data_ptr``) but with one entry fewer, another
    dtype or other strides, a state tensor is not what the calls run on either: check_invariants names it as
    it names one moved elsewhere (helper-204's mutation run: comparing addresses alone passed every test)."""
    import torch
    import tpool
    pool = tpool.PagePool(16, page_size=4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    table.extend(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32))
    t = getattr(pool.state if owner == "pool" else table.state, name)
    kept, ptr = t.view(t.shape), t.data_ptr()
    if edit == "fewer entries":
        t.set_(t.untyped_storage(), t.storage_offset(), (t.numel() - 1,))
    elif edit == "another dtype":
        t.data = t.view(torch.uint32)
    else:
        t.set_(t.untyped_storage(), t.storage_offset(), t.shape, (1, t.shape[0]))
    assert t.data_ptr() == ptr
    for check in (table.check_invariants,) + ((pool.check_invariants,) if owner == "pool" else ()):
        with pytest.raises(tpool.InvariantViolation, match=rf"state tensor '{name}' was re-pointed by hand"):
            check()
    t.data = kept                                  # set back (set_ keeps the dtype): checked again
    table.check_invariants()
    pool.check_invariants()


def test_a_memo_naming_a_request_twice_stays_within_the_csr(backend):
    """A memo edited to name one request in every lane, one step behind: the CSR ends within its
    capacity on every backend; on numba (the only one that reads the memo) the step, whose lanes hold
    more pages than its first pass counted, is counted as corrupt state."""
    r = repro(backend)["memo_names_a_request_twice"]
    assert r["end"] <= r["capacity"]
    if backend == "numba":
        assert r["corrupt"] == 1


def test_backends_agree_on_corrupt_state():
    """Every output and count of the reproducers is the same on every backend (but for a hand-edited step
    memo: numba's own bookkeeping, which the other backends do not read)."""
    def outcomes(b):
        return {k: v for k, v in repro(b).items() if k != "memo_names_a_request_twice"}
    want = outcomes("reference")
    for b in CPU_BACKENDS[1:]:
        assert outcomes(b) == want, b


def test_a_hand_edit_without_invalidate_csr_never_exports_a_page_outside_the_pool(backend):
    """A row's length raised, or its newest page made wild, without ``invalidate_csr``, then a step
    on a StepOut one step behind: numba grew the CSR in place from the row and exported ids outside
    the pool (-1, INT32_MAX) with their kv_lens. A version cell edited to -1 made a memo holding no CSR
    look current (the buffer's -1 padding exported as pages). Now each such request is exported empty."""
    stale = repro(backend)["stale_csr"]
    for edit in ("length", "page"):
        got = stale[edit]
        assert got["indptr"] == [0, 0] and got["kv_lens"] == [0] and set(got["indices"]) == {-1}, edit
        assert got["slots"] == [-1, -1, -1, -1] and got["corrupt"] == 2, edit
    assert stale["version"] == dict(indptr=[0, 0], indices=[-1, -1], kv_lens=[0], corrupt=2)


def test_a_short_corruption_fuzz_finds_nothing(tmp_path):
    """``tests/fuzz_corrupt.py`` for three seeds: random calls, misuse and hand edits of the state on numba,
    its kernels compiled with ``NUMBA_BOUNDSCHECK=1`` and their raw-memory helpers checked, every output
    bounded after every call. Seed 244 exported a page outside the pool within 100 operations before the
    one-step-behind decode checked the pages it copies from rows; longer runs: see the script. ``--fixed``
    first runs its hand-written episodes (LRU-queue entries of P, -1 and P + 1): a queue check accepting
    page P read one past the page state, which these 900 random operations did not show."""
    p = subprocess.run([sys.executable, str(HERE / "fuzz_corrupt.py"), "--fixed", "--ops", "300", "--seed", "244",
                        "--seeds", "3", "--batch", "3", "--cache-dir", str(tmp_path / "cache"), "--findings", str(tmp_path / "found")],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["ops"] == 900 and summary["fixed_ops"] == 30
    assert summary["findings"] == 0 and summary["crashes"] == []
    assert summary["raw_check"] and summary["canary"]


_PAST_THE_END = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
import fuzz_corrupt as F
F.install_canaries()
import tpool
pool = tpool.PagePool(4, device="cpu", backend="numba")
assert F.overwritten_guards() == []
t = pool.state.free_stack
ctypes.c_int32.from_address(t.data_ptr() + t.nbytes).value = -1  # one id past the stack, as a memset would write
print([size for size, _, _ in F.overwritten_guards()], F.overwritten_guards())
"""


def test_the_corruption_fuzzer_sees_a_raw_write_starting_at_a_tensors_end():
    """The raw check refuses a range that straddles the edge of a tpool allocation; one that starts at its end
    lies outside every allocation and passes (inputs are the caller's tensors). ``--canary`` (default for numba)
    puts guard bytes around every allocation and checks them after each operation: such a write is seen,
    once."""
    p = subprocess.run([sys.executable, "-c", _PAST_THE_END, str(HERE)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["[16]", "[]"]  # the 4-page stack's 16 bytes; reported once, then restored


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_a_short_corruption_fuzz_on_interpreted_triton_finds_nothing(tmp_path):
    """The same fuzzer on the Triton kernels, interpreted, with ``tests/triton_guard.py`` checking that
    every access lies inside the tensors a launch was given (the interpreter checks none) and the kernels
    working in chunks of 4 lanes (their multi-chunk paths)."""
    p = subprocess.run([sys.executable, str(HERE / "fuzz_corrupt.py"), "--backend", "triton", "--block", "4",
                        "--fixed", "--ops", "250", "--seed", "9300", "--seeds", "2", "--batch", "2",
                        "--findings", str(tmp_path / "found")], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["ops"] == 500 and summary["fixed_ops"] == 30
    assert summary["findings"] == 0 and summary["crashes"] == []
