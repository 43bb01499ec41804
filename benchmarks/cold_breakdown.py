"""Where a cold decode step's time goes: façade, kernel, memory it touches, and floors, in one run.

A decode step at B=256 (``bench_page_table.py``'s workload: prompts 512-2048 tokens,
pages of 16) timed one call at a time with 64 MiB written before each call, as in
``bench_page_table.py --cold``. Every row below is timed the same way and the rows
take turns sample by sample, so the machine's noise falls on all of them alike.

Rows, from the floor up:

* ``python call``: a plain Python function call (the timing loop's own cost).
* ``numba no-op``: a numba entry point called with one int (what calling any kernel costs).
* ``touch: inputs``: a numba function reading the call descriptor, ``req_ids`` and ``num_tokens``.
* ``touch: + lengths, outputs, memo``: also reads and writes ``seq_lens`` of every lane, writes
  ``slots``, ``ok``, ``indptr``, ``last_page_len`` and reads the memo's ids (everything a
  decode step touches but the CSR's page ids and the block table).
* ``touch: + CSR shift``: also moves the CSR's page ids right by one from the first lane that
  gained a page (what growing the CSR in place costs: the runs after a grown lane move; at
  B=256 with prompts of 512-2048 tokens, ~80 KiB of page ids).
* ``touch: + CSR shift + block-table rows``: also reads each lane's last page from its row (one
  line per lane: what the step did before its memo kept the last pages).
* ``kernel alone``: the compiled step entry called directly with the bound call's descriptor;
  ``..., code warm``: the same call right after another table's step ran (untimed, after the
  flush): the code of the call path is in the caches, this table's memory is not, so the
  difference to ``kernel alone`` is what fetching cold code costs.
* ``extend kernel alone (no CSR)``: only the extend (slots and lengths, read from the rows).
* ``façade only``: ``BoundStep``'s Python part (``bound_step._bound_step``) around the no-op
  instead of the kernel; ``..., as a closure (before)``: the same check as the closure it was.
* ``bound step``: ``table.bind_step(ids, ones)()``; ``..., table-made inputs``: ``table.bind_step(batch=B)``
  filled with the same ids and counts, whose call checks nothing (no torch call).
* ``step``: ``table.step(ids, ones)`` (bound on its own from the second call).
The step reads each decode lane's length and last page from the step memo's tails (written
by the step before), not from ``seq_lens`` and the block-table rows; the ``touch: + block-table
rows`` row shows what reading the rows cost it before. Prototypes measured earlier and not
taken (reading lengths from the previous CSR, a prefetch pass over the rows) are described in
``benchmarks/RESULTS.md``.

    python benchmarks/cold_breakdown.py                 # B=256, 200 samples a row, ~1 min
    python benchmarks/cold_breakdown.py --batch 64 256 --samples 400 --json cold.json
"""

import argparse
import functools
import os
import random
import sys
import time

import numba
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, COLD_BYTES, CacheFlusher, HelpFormatter, out_path, positive_int,  # noqa: E402
                     print_table, progress, quantiles, size_text, write_json)
from bench_page_table import PAGE_SIZE, make_reset, setup  # noqa: E402

from tpool.kernels import layout as L  # noqa: E402
from tpool.kernels._numba_util import (i32_array, i64_array, move_i32, page_shift, table_arrays,  # noqa: E402
                                       u8_array)
from tpool.backends.numba import _desc, entry_point  # noqa: E402
from tpool.kernels import extend  # noqa: E402
from tpool.errors import StaleBinding  # noqa: E402
from tpool._checks import storage_size  # noqa: E402
from tpool.bound_step import _bound_step  # noqa: E402

_i64 = numba.types.int64


@numba.njit(nogil=True)
def noop(x):
    return x


@numba.njit(nogil=True)
def touch_inputs(cd_addr):
    cd = i64_array(cd_addr, L.CALL_DESC_LEN)
    B = cd[L.CD_LANES]
    ids, ntok = i32_array(cd[L.CD_IDS], B), i32_array(cd[L.CD_NTOK], B)
    s = 0
    for i in range(B):
        s += ids[i] + ntok[i]
    return s


@numba.njit(nogil=True)
def touch_lanes(cd_addr, rows, shift):
    """Reads and writes what a decode step does; ``rows``: also the block-table rows; ``shift``: also
    moves the CSR's ids right by one past the first lane whose length is a multiple of the page size
    (the memmove a grown CSR makes; the row's reset, untimed, puts the ids back)."""
    cd = i64_array(cd_addr, L.CALL_DESC_LEN)
    B = cd[L.CD_LANES]
    bt, lens, _, ps = table_arrays(cd[:L.CD_STATE])
    ids, ntok = i32_array(cd[L.CD_IDS], B), i32_array(cd[L.CD_NTOK], B)
    slots, ok = i32_array(cd[L.CD_SLOTS], B), u8_array(cd[L.CD_OK], B)
    indptr, last = i32_array(cd[L.CD_INDPTR], B + 1), i32_array(cd[L.CD_LAST_PAGE_LEN], B)
    memo = i64_array(cd[L.CD_CSR_MEMO], L.MEMO_IDS + B)
    diff = 0
    for i in range(B):
        diff |= memo[L.MEMO_IDS + i] ^ ids[i]
    pos = 0
    first = -1
    bits = page_shift(ps)  # a power of two here: shifts, as the kernel (a division per lane would dominate)
    for i in range(B):
        r = np.uint64(ids[i])
        length = lens[r]
        k, off = np.uint64(length >> bits), length & (ps - 1)
        page = bt[r, k] if rows else 7
        slots[i] = page * ps + off
        lens[r] = length  # written back unchanged: the table stays as it is
        ok[i] = ntok[i] == 1
        pos += k + 1
        indptr[i + 1] = pos
        last[i] = off + 1
        if first < 0 and off == 0:
            first = pos
    if shift and bits >= 0 and first >= 0:  # move [first, pos) right by one
        move_i32(cd[L.CD_INDICES] + 4 * (first + 1), cd[L.CD_INDICES] + 4 * first, pos - first - 1)
    return diff


def closure_facade(req_ids, num_tokens, b, run):
    """``BoundStep``'s Python part as it was before ``bound_step._bound_step``: a closure (nine cells)."""
    ids_at, ntok_at, ids_len, ntok_len = req_ids.data_ptr, num_tokens.data_ptr, req_ids.numel, num_tokens.numel
    at_ids, at_ntok = ids_at(), ntok_at()
    result = object()

    def step():
        if ids_at() != at_ids or ntok_at() != at_ntok or ids_len() != b or ntok_len() != b:
            raise StaleBinding("moved")
        run()
        return result
    return step


def bound_run(bound):
    """The numba backend's bound call inside a ``BoundStep`` (its ``run``, whose ``held[0]`` is the descriptor)."""
    return next(a for a in bound.args if isinstance(a, functools.partial) and hasattr(a, "held"))


def rows_for(B):
    """name -> (fn, reset, settle, after_flush) for one batch size (module note), and what they need kept alive."""
    dev = torch.device("cpu")
    _, table, _ = setup(B, "numba", dev, random.Random(B))
    ids = torch.arange(B, dtype=torch.int32)
    ones = torch.ones(B, dtype=torch.int32)
    bound = table.bind_step(ids, ones)
    fixed = table.bind_step(batch=B)  # the same shape's buffers and memo as ``bound``
    fixed.req_ids[:] = ids.numpy()  # numpy arrays on a CPU
    fixed.num_tokens[:] = 1
    step = functools.partial(table.step, ids, ones)
    run = bound_run(bound)
    cd_arr = run.held[0]
    addr = int(cd_arr.ctypes.data)
    reset = make_reset(bound, table)

    noop_run = functools.partial(entry_point(noop, _i64), addr)
    touch_entry = entry_point(touch_lanes, _i64, numba.types.boolean, numba.types.boolean)

    def touch(rows, shift):
        return functools.partial(touch_entry, addr, rows, shift)

    indices = bound.result.csr.indices  # the touch rows shift it: their reset puts it back (untimed)
    saved_indices = indices.clone()

    def touch_reset():
        reset()
        indices.copy_(saved_indices)

    # Another table of the same shape: its kernel alone, run after the flush, warms the call path's code only.
    _, other, _ = setup(B, "numba", dev, random.Random(B + 1))
    other_run = bound_run(other.bind_step(ids, ones))
    other_reset = make_reset(other_run, other)
    out = {
        "python call": (lambda: None, None),
        "numba no-op": (noop_run, None),
        "touch: inputs": (functools.partial(entry_point(touch_inputs, _i64), addr), None),
        "touch: + lengths, outputs, memo": (touch(False, False), touch_reset),
        "touch: + CSR shift": (touch(False, True), touch_reset),
        "touch: + CSR shift + block-table rows": (touch(True, True), touch_reset),
        "kernel alone": (run, reset),
        "kernel alone, code warm": (run, reset, other_run),
        "extend kernel alone (no CSR)": (functools.partial(entry_point(extend.extend_numba_entry, _i64, _i64, _i64,
                                                                       _desc), ids.data_ptr(), ones.data_ptr(), B,
                                                       cd_arr), reset),
        "façade only": (functools.partial(_bound_step, ids.data_ptr, ones.data_ptr, ids.numel, ones.numel,
                                          ids.data_ptr(), ones.data_ptr(), B, *storage_size(ids), *storage_size(ones),
                                          noop_run, bound.result), None),
        "façade only, as a closure (before)": (closure_facade(ids, ones, B, noop_run), None),
        "bound step": (bound, reset),
        "bound step, table-made inputs": (fixed, reset),
        "step": (step, reset),
    }
    # (fn, reset, settle, after_flush): each settles itself; the code-warm row runs the other table's
    # kernel after the flush (it resets that table first, so every sample grows the same CSR)
    out = {name: (row[0], row[1], row[0], row[2] if len(row) > 2 else None) for name, row in out.items()}
    return out, (table, ids, ones, bound, fixed, other, other_reset)


def parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter,
                                 epilog="Progress goes to stderr.")
    ap.add_argument("--batch", type=positive_int, nargs="+", action=Distinct,
                    default=[256], metavar="B", help="requests in the batch")
    ap.add_argument("--samples", type=positive_int, default=200, help="cold calls timed per row")
    ap.add_argument("--cold-bytes", type=positive_int, default=COLD_BYTES, help="bytes written before each timed call")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    flush = CacheFlusher(args.cold_bytes)
    out, table_rows = [], []
    for B in args.batch:
        progress(f"B={B}: setting up and compiling")
        rows, keep = rows_for(B)
        other_reset = keep[-1]
        for fn, reset, settle, _ in rows.values():  # compile, bind
            fn()
            fn()
            if reset:
                reset()
        times = {name: [] for name in rows}
        progress(f"B={B}: {args.samples} cold samples of {len(rows)} rows, in turns")
        for s in range(args.samples):
            for name, (fn, reset, settle, after_flush) in rows.items():
                if reset:
                    reset()
                settle()  # untimed: the timed call grows the CSR this one left
                if after_flush:
                    other_reset()
                    after_flush()  # settles the other table's CSR too: its next call is a grown step
                flush()
                if after_flush:
                    after_flush()
                t0 = time.perf_counter_ns()
                fn()
                times[name].append((time.perf_counter_ns() - t0) / 1e3)
            if s % 50 == 49:
                progress(f"B={B}: sample {s + 1}/{args.samples}")
        for reset in {r for _, r, _, _ in rows.values() if r}:
            reset()
        base = quantiles(times["bound step"])[0]
        for name, xs in times.items():
            med, p20, p80 = quantiles(xs)
            out.append(dict(batch=B, row=name, cold_median_us=med, cold_p20_us=p20, cold_p80_us=p80,
                            x_bound_step=med / base))
            table_rows.append([B, name, f"{med:.2f}", f"{p20:.2f}", f"{p80:.2f}", f"{med / base:.2f}"])
    print_table(f"cold decode step, {size_text(flush.buf.nbytes)} written before each call, pages of {PAGE_SIZE} "
                f"(us per call)", ["B", "row", "cold median", "p20", "p80", "x bound step"], table_rows)
    write_json(args.json, "cold_breakdown", out)


if __name__ == "__main__":
    main()
