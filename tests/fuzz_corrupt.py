"""Memory-safety fuzzer: random calls, misuse and hand edits of the state, outputs bounded after every call.

Where ``tests/fuzz_lockstep.py`` compares backends, this fuzzer checks the safety promise
of the README ("Reliability"; "Bad input and bad state: what happens") on one backend:
no input, hand-edited state or call order may make a kernel read or write memory it was
not given, and no page id outside the pool leaves tpool.

Each episode builds one small pool and table (sizes vary: page_size 1, one-page pools,
one-column tables...) and runs random operations over the public surface:
``alloc`` (plain, ``out=``, ``bind_alloc``, ``evict=``), ``free`` (plain, ``bind_free``,
inside a free group, ``cache=``), ``incref``, ``touch``, ``evict``, ``extend``, ``step``
(``release=``, ``release_cache=``, ``out=`` two ``StepOut`` buffers taking turns, small
and large ``capacity`` and ``max_tokens``, the same tensors again so the table binds
them), ``bind_step`` (tensor inputs, and ``batch=B`` with ``release=K``), ``fork``,
``truncate`` (``new_lens`` and ``drop``), ``release``, ``revive`` (with ``generations``: the
pages' own, or any values), ``flashinfer_csr``,
``block_table_rows``, ``invalidate_csr`` (all rows or some), snapshots and restores of
the state, and the sync points (``check``, ``check_invariants``, ``stats``,
``available``). Request ids and page ids include -1, ids out of range, repeated ids and
the int32 extremes; counts include negatives and huge values.

Between calls it edits the state by hand: any value (negatives, huge, the INT32 and
INT64 extremes, ids out of range, values near the current one) into any state tensor
of the pool (``free_stack``, ``refcount``, ``page_state``, ``stamp``, ``page_gen``, every
``counters`` slot, ``checked``, the scratch ``claim``/``occur``/``keys``) and of the
table (``block_table``, ``seq_lens``, ``claim``, ``lane_end``, ``version``,
``row_version``), copies of one row into another, versions copied from a step's memo
(so a memo looks current), followed by ``invalidate_csr()``, by ``invalidate_csr(rows)``
or by nothing. ``--memo-edits`` also edits a step's CSR memo (outside the promise: the
README does not cover writes into a step's buffers).

After every call it checks the outputs: slots in ``[-1, P * page_size)``; CSR ``indptr``
starting at 0, non-decreasing, never past ``indices``; ``indices[:indptr[B]]`` page ids
of the pool, -1 past it; ``last_page_len`` in ``[1, page_size]``; ``kv_lens`` in
``[0, max_pages * page_size]`` and no longer than the lane's CSR run holds; positions in
``[-1, max_pages * page_size)``; ``qo_indptr`` non-decreasing in ``[0, max_tokens]``;
``alloc``'s pages and evicted ids, fork's copy pairs and evict's ids in ``[-1, P)``.
A ``ValueError``/``TypeError`` (argument checks, ``StaleBinding``) and tpool's
``PoolError``s at ``check()``/``check_invariants()`` are expected; anything else is a
finding: an ``IndexError`` (with ``NUMBA_BOUNDSCHECK=1`` numba raises it instead of
reading or writing past an array), any other exception, a violated output bound, a
crash or a hang of the worker process.

With ``--raw-check`` (default for numba) the worker also replaces, before any kernel is
compiled, the kernels' raw-memory helpers (``move_i32``, ``copy_i32``,
``fill_null_i32``, and the arrays made from an address plus an offset: ``i32_array``,
``i64_array``, ``u8_array``, ``i64_cell``) with checked twins: no memory range they
touch may straddle the edge of an allocation tpool made (``tpool.state.fixed_full``), which
numba's bounds check alone cannot see (a ``carray`` over ``address + 4 * offset`` has
the bounds it is given). Raw checks use their own numba cache directory. A range wholly
outside every such allocation passes (the inputs are the caller's tensors), so a raw
write that starts at or past a tensor's end (into the allocator's padding beside it) is
not seen there: ``--canary`` (default for numba) gives every ``fixed_full`` allocation
``CANARY`` guard bytes on each side and checks them after every operation, so such a
write is a finding.

With ``--backend triton`` the workers run Triton's interpreter (``TRITON_INTERPRET=1``) under
``tests/triton_guard.py``'s address check: every load, store and atomic of a kernel must lie
inside one of the tensors it was given (the interpreter itself checks nothing); ``--block 4``
makes the kernels work in chunks of 4 lanes, so small batches run their multi-chunk paths.

Usage::

    python tests/fuzz_corrupt.py --ops 2000 --seed 0 --seeds 20            # numba, bounds-checked
    python tests/fuzz_corrupt.py --fixed --seeds 0                         # only the hand-written episodes
    python tests/fuzz_corrupt.py --backend reference --ops 2000 --seeds 5
    python tests/fuzz_corrupt.py --backend triton --block 4 --ops 250 --seeds 4
    python tests/fuzz_corrupt.py --replay $TMPDIR/tpool-fuzz-corrupt/findings/numba_seed12_ep0.json --shrink

The parent runs the seeds in worker subprocesses (``--batch`` seeds each) with
``NUMBA_BOUNDSCHECK=1`` and ``NUMBA_CACHE_DIR`` set (``--cache-dir``), so a segfault or a
hang is caught and its seed recorded. Findings are written as JSON (config and the op
list up to the failing op) to ``--findings`` and can be replayed and shrunk. Progress
goes to stderr; the exit status is 1 when anything was found.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
OPS_PER_EPISODE = 250
_HOME = os.path.join(tempfile.gettempdir(), "tpool-fuzz-corrupt")
DEFAULT_CACHE = os.path.join(_HOME, "cache")        # kernels compiled with NUMBA_BOUNDSCHECK=1 (not the usual cache)
DEFAULT_FINDINGS = os.path.join(_HOME, "findings")

I32_SPECIAL = (INT32_MIN, INT32_MIN + 1, -10**9, -65536, -7, -2, -1, 0, 1, 2, 3, 4, 5, 8, 16, 63, 64, 65,
               2**16, 10**9, INT32_MAX - 1, INT32_MAX)
I64_SPECIAL = I32_SPECIAL + (INT64_MIN, INT64_MIN + 1, -2**62, -2**32, 2**31, 2**32 - 1, 2**32, 2**32 + 3,
                             2**62, INT64_MAX - 1, INT64_MAX)
I8_SPECIAL = (-128, -1, 0, 1, 2, 3, 4, 127)

CANARY = 64  # guard bytes on each side of every fixed_full allocation, with --canary (kept 16-byte aligned)
GUARD_BYTE = 0x5A
_GUARDED = []  # weak references to the guarded allocations (uint8 arrays: guard, tensor bytes, guard)

CHECK_PADDING = True  # -1 past indptr[B] (off with --memo-edits: a memo's MEMO_WRITTEN edited smaller leaves stale
#                       entries there, which no reader bounded by indptr sees)


class Violation(AssertionError):
    """An output outside the bounds the README promises."""


# ------------------------------------------------------------------ generation
def gen_config(rng: random.Random) -> dict:
    ps = rng.choice([1, 1, 2, 3, 4, 4, 8])
    P = rng.choice([1, 1, 2, 3, 4, 5, 6, 8, 9, 16, 33])
    R = rng.choice([1, 2, 3, 4, 6, 8])
    MP = rng.choice([1, 2, 3, 4, 5, 8])
    max_batch = rng.choice([1, 2, 4, 8, 8, 16])
    turns = []  # the shapes (B, max_tokens, capacity) of the episode's StepOut pairs (overlap scheduling)
    for _ in range(2):
        b = rng.randint(1, min(max_batch, rng.choice([1, 2, 4, 10])))
        turns.append([b, max(b, min(max_batch * MP * ps, rng.choice([b, 2 * b, b * (ps + 1), 3 * b * ps]))),
                      None if rng.random() < 0.7 else rng.randint(0, b * MP)])
    return dict(num_pages=P, page_size=ps, max_requests=R, max_pages=MP, max_batch=max_batch,
                max_shapes=rng.choice([2, 4, 64]), edit_weight=rng.choice([2, 6, 16, 30]), turns=turns)


def _some_id(rng, n, wild):
    """An id in ``[0, n)`` (85%), -1 (8%), or one of ``wild``."""
    u = rng.random()
    if u < 0.85:
        return rng.randrange(n)
    return -1 if u < 0.93 else rng.choice(wild)


def _rid(rng, cfg):
    R = cfg["max_requests"]
    return _some_id(rng, R, [R, R + 1, R + 17, -2, -7, INT32_MAX, INT32_MIN, 2**16])


def _ids(rng, cfg, b, distinct=False):
    if distinct and rng.random() < 0.7:
        pool = list(range(cfg["max_requests"]))
        rng.shuffle(pool)
        out = [pool[i] if i < len(pool) else -1 for i in range(b)]
        if rng.random() < 0.3:
            out = [(-1 if rng.random() < 0.3 else x) for x in out]
        return out
    return [_rid(rng, cfg) for _ in range(b)]


def _page(rng, cfg):
    P = cfg["num_pages"]
    return _some_id(rng, P, [P, P + 1, P + 100, -2, -9, INT32_MAX, INT32_MIN])


def _pages(rng, cfg, b):
    return [_page(rng, cfg) for _ in range(b)]


def _ntok(rng, cfg, b, decode=False):
    ps = cfg["page_size"]
    out = []
    for _ in range(b):
        u = rng.random()
        if decode or u < 0.55:
            out.append(1)
        elif u < 0.9:
            out.append(rng.randint(0, 3 * ps + 2))
        elif u < 0.96:
            out.append(rng.choice([-1, -3, INT32_MIN]))
        else:
            out.append(rng.choice([cfg["max_pages"] * ps, cfg["max_pages"] * ps + 1, 10**6, INT32_MAX]))
    return out


def _batch(rng, cfg):
    mb = cfg["max_batch"]
    if rng.random() < 0.02:
        return mb + 1  # past max_batch: ValueError
    return min(rng.choice([0, 1, 1, 2, 2, 3, 4, 5, 8, 12, 16]), mb)  # past KEEP_LOOKAHEAD (8) too


def _most_tokens(cfg):
    return cfg["max_batch"] * cfg["max_pages"] * cfg["page_size"]


def _max_tokens(rng, cfg, ntok):
    s = sum(max(n, 0) for n in ntok)
    u = rng.random()
    if u < 0.1:
        return None
    if u < 0.13:
        return rng.choice([0, -1, _most_tokens(cfg) + 1, True, 2.0])  # refused
    if u < 0.3:
        return rng.randint(1, max(1, min(s, _most_tokens(cfg))))  # maybe too small: out_overflow
    hi = _most_tokens(cfg)
    return max(1, min(hi, s + rng.randint(0, 3)))


def _capacity(rng, cfg, b):
    u = rng.random()
    if u < 0.55:
        return None
    if u < 0.58:
        return rng.choice([-1, cfg["max_batch"] * cfg["max_pages"] + 1, True])  # refused
    if u < 0.85:
        return rng.randint(0, max(0, b * cfg["max_pages"]))
    return rng.randint(0, cfg["max_batch"] * cfg["max_pages"])


def _edit_value(rng, cfg, dtype_kind, near=()):
    P, R, MP, ps = cfg["num_pages"], cfg["max_requests"], cfg["max_pages"], cfg["page_size"]
    u = rng.random()
    if u < 0.2:
        return ["rel", rng.choice([-3, -2, -1, 1, 2, 3, ps, -ps, ps - 1, ps + 1])]
    if u < 0.5:
        local = [P - 1, P, P + 1, R - 1, R, R + 1, MP, MP * ps - 1, MP * ps, MP * ps + 1, ps, ps + 1, *near]
        return rng.choice([v for v in local if v >= -1] or [0])
    if dtype_kind == "i8":
        return rng.choice(I8_SPECIAL)
    if dtype_kind == "i64":
        return rng.choice(I64_SPECIAL)
    return rng.choice(I32_SPECIAL)


def gen_edit(rng, cfg):
    from tpool.kernels import layout as L  # (constants only)
    P, R, MP = cfg["num_pages"], cfg["max_requests"], cfg["max_pages"]
    if rng.random() < 0.5:
        names = ["seq_lens", "seq_lens", "block_table", "block_table", "block_table", "claim", "lane_end", "copyrow"]
        if not cfg.get("no_version_edits"):
            names += ["version", "row_version", "memo_version"]
        name = rng.choice(names)
        if name == "copyrow":
            return ["table", name, rng.randrange(R), rng.randrange(R), None]
        if name == "memo_version":  # a memo's (valid) version into a version cell: that memo looks current
            return ["table", name, rng.randrange(2), rng.randrange(8), None]
        if name == "block_table":
            return ["table", name, rng.randrange(R * MP), _edit_value(rng, cfg, "i32", (-1, 0)), None]
        size = {"seq_lens": R, "claim": R, "lane_end": cfg["max_batch"], "version": 2, "row_version": R}[name]
        kind = "i64" if name in ("version", "row_version") else "i32"
        return ["table", name, rng.randrange(size), _edit_value(rng, cfg, kind), None]
    name = rng.choice(["free_stack", "free_stack", "refcount", "page_state", "page_state", "stamp", "counters",
                       "counters", "counters", "checked", "claim", "occur", "keys", "page_gen", "lru_queue",
                       "lru_queue", "lru_pos"])
    if name == "counters":
        slot = rng.choice([0, 0, 0, 1, 1, 2, 2, L.LRU_HEAD, L.LRU_TAIL, L.LRU_HOLE, L.LRU_SCAN]
                          + list(range(L.NUM_COUNTERS)))
        return ["pool", name, slot, _edit_value(rng, cfg, "i64", (0, P // 2, 2 * P, 3 * P, 4 * P)), None]
    kind = {"page_state": "i8", "stamp": "i64", "checked": "i64", "keys": "i64", "lru_pos": "i64"}.get(name, "i32")
    size = {"checked": L.NUM_COUNTERS, "lru_queue": L.LRU_FACTOR * P}.get(name, P)
    return ["pool", name, rng.randrange(size), _edit_value(rng, cfg, kind), None]


def gen_op(rng: random.Random, cfg: dict, memo_edits: bool) -> list:
    """One operation as plain JSON data (so a failing sequence replays and prints)."""
    kinds = ["alloc", "free", "incref", "touch", "evict", "extend", "step", "turns", "repeat", "bstep", "fork",
             "truncate", "release", "csr", "rows", "invalidate", "edit", "check", "invariants", "stats", "snap",
             "restore", "group", "memo", "poke", "revive"]
    weights = [6, 6, 3, 2, 2, 9, 12, 6, 6, 7, 5, 5, 5, 5, 2, 2, cfg.get("edit_weight", 16), 2, 1, 1, 3, 3, 2,
               2 if memo_edits else 0, cfg.get("edit_weight", 16) // 2, 4]
    kind = rng.choices(kinds, weights)[0]
    b = _batch(rng, cfg)
    P, MP, ps = cfg["num_pages"], cfg["max_pages"], cfg["page_size"]
    if kind == "alloc":
        counts = [rng.choice([-1, -5, INT32_MIN]) if rng.random() < 0.05 else
                  rng.choice([0, 1, 1, 2, 3, P, P + 1, INT32_MAX]) if rng.random() < 0.2 else rng.randint(0, 2)
                  for _ in range(b)]
        mode = rng.choice(["plain", "plain", "out", "bind"])
        return [kind, counts, mode, rng.random() < 0.4, rng.randrange(2)]
    if kind in ("free", "incref", "touch"):
        pages = _pages(rng, cfg, b)
        if kind == "free" and rng.random() < 0.15:
            pages = pages + [-1] * rng.choice([60, 64, 70, 130])  # a padded tail (free skips it by blocks)
        mode = rng.choice(["plain", "plain", "bind"]) if kind == "free" else "plain"
        return [kind, pages, rng.random() < 0.4, mode]
    if kind == "evict":
        k = rng.choice([0, 1, 2, P, P + 3, rng.randint(0, 2 * P + 2)])
        return [kind, k, rng.random() < 0.5]
    if kind == "extend":
        ntok = _ntok(rng, cfg, b)
        return [kind, _ids(rng, cfg, b), ntok, _max_tokens(rng, cfg, ntok)]
    if kind == "step":
        ntok = _ntok(rng, cfg, b, decode=rng.random() < 0.4)
        rel = None
        if rng.random() < 0.3:
            rel = _ids(rng, cfg, rng.randint(0, min(3, cfg["max_batch"] + (rng.random() < 0.05))))
        return [kind, _ids(rng, cfg, b, distinct=True), ntok, _max_tokens(rng, cfg, ntok), _capacity(rng, cfg, b),
                rel, rng.random() < 0.3]
    if kind == "turns":  # steps into one of the episode's two StepOut pairs, taking turns; later steps decode
        bb, T, cap = cfg["turns"][rng.randrange(2)] if "turns" in cfg else (1, 1, None)
        ntok = _ntok(rng, cfg, bb, decode=rng.random() < 0.6)
        ids = None if rng.random() < 0.6 else _ids(rng, cfg, bb, distinct=True)  # None: the last batch again
        return [kind, ids, ntok, T, cap, rng.randint(1, 5)]
    if kind == "repeat":  # the same tensor objects again: the table binds them (step_binding)
        bb = max(1, min(b, cfg["max_batch"]))
        ntok = _ntok(rng, cfg, bb, decode=rng.random() < 0.6)
        ids = None if rng.random() < 0.5 else _ids(rng, cfg, bb, distinct=True)  # None: the last batch again
        return [kind, ids, ntok, rng.randint(1, 6), rng.random() < 0.2]
    if kind == "bstep":
        bb = rng.choice([1, 2, 3, 4, 10])
        bb = min(bb, cfg["max_batch"])
        K = rng.choice([None, None, 1, 2, 3])
        if K is not None and K > cfg["max_batch"] and rng.random() < 0.9:
            K = cfg["max_batch"]
        T = rng.choice([bb, bb, bb * 2, bb * ps + 1])
        T = max(1, min(T, _most_tokens(cfg)))
        cap = rng.choice([None, None, 0, 1, bb * MP])
        fixed = rng.random() < 0.6
        use_out = rng.random() < 0.25
        ntok = _ntok(rng, cfg, bb, decode=rng.random() < 0.6)
        rel = _ids(rng, cfg, K) if K is not None and rng.random() < 0.5 else ([-1] * K if K else None)
        ids = None if rng.random() < 0.5 else _ids(rng, cfg, bb, distinct=True)  # None: the last batch again
        return [kind, bb, T, cap, K, fixed, use_out, rng.random() < 0.3, ids, ntok, rel, rng.randint(1, 4)]
    if kind == "fork":
        lens = [rng.choice([-1, INT32_MAX, INT32_MIN]) if rng.random() < 0.05 else rng.randint(0, MP * ps)
                for _ in range(b)]
        return [kind, _ids(rng, cfg, b), _ids(rng, cfg, b), lens]
    if kind == "revive":  # pages in any state, into a row that may hold pages, be out of range or not a row
        k = rng.randint(0, MP + (rng.random() < 0.1))
        row = rng.choice([-1, INT32_MAX, cfg["max_requests"]]) if rng.random() < 0.05 else rng.randrange(
            cfg["max_requests"])
        n = k * ps if rng.random() < 0.9 else rng.choice([k * ps + 1, -ps])
        u = rng.random()  # generations: none, the pages' own at the call, or any values (one entry per page)
        gens = None if u < 0.4 else "own" if u < 0.7 else [rng.choice(I32_SPECIAL[:12]) for _ in range(k)]
        return [kind, row, _pages(rng, cfg, k), n, gens]
    if kind == "truncate":
        drop = rng.random() < 0.5
        lens = [rng.choice([-1, INT32_MAX, INT32_MIN, -2**30]) if rng.random() < 0.07 else
                rng.randint(0, 2 * ps if drop else MP * ps) for _ in range(b)]
        return [kind, _ids(rng, cfg, b), lens, drop]
    if kind == "release":
        return [kind, _ids(rng, cfg, b), rng.random() < 0.4]
    if kind == "csr":
        return [kind, _ids(rng, cfg, b), _capacity(rng, cfg, b)]
    if kind == "rows":
        return [kind, _ids(rng, cfg, b)]
    if kind == "invalidate":
        return [kind, None if rng.random() < 0.5 else _ids(rng, cfg, rng.randint(0, 3))]
    if kind == "edit":
        n = 1 if rng.random() < 0.7 else rng.randint(2, 5)
        edits = [gen_edit(rng, cfg) for _ in range(n)]
        rows = sorted({e[2] if e[1] == "seq_lens" else e[2] // MP if e[1] == "block_table" else e[3]
                       for e in edits if e[0] == "table" and e[1] in ("seq_lens", "block_table", "copyrow")})
        u = rng.random()
        if cfg.get("contract"):  # the README's contract: invalidate_csr(), or naming every row edited
            only_rows = all(e[0] == "table" and e[1] in ("seq_lens", "block_table", "copyrow") for e in edits)
            inv = "rows" if only_rows and u < 0.4 else "all"
        else:
            inv = "none" if u < 0.45 else "all" if u < 0.85 else "rows"
        return [kind, edits, inv, rows]
    if kind == "memo":
        return [kind, rng.randrange(64), rng.randrange(10**6), _edit_value(rng, cfg, "i64")]
    if kind == "poke":  # a hand edit aimed at a decode loop's running batch, then more decode steps of it
        field = rng.choice(["seq_lens", "seq_lens", "block_table", "block_table", "free_stack", "free_count"])
        if field == "seq_lens":
            value = ["rel", rng.choice([1, 2, ps - 1, ps, ps + 1, 2 * ps, -1, -ps])] if rng.random() < 0.7 else \
                rng.choice([0, MP * ps - 1, MP * ps, MP * ps + 1, -1, INT32_MAX, INT32_MIN])
            spec = 0
        elif field == "block_table":
            spec = rng.choice([-2, -1, 0, 0, 1, 2])  # column relative to the row's last page
            value = rng.choice([-1, -1, P, P + 5, INT32_MAX, INT32_MIN, -2, rng.randrange(P)])
        elif field == "free_stack":
            spec = rng.choice([0, 0, 1, 2])  # entry below the top
            value = rng.choice([-1, P, P + 5, INT32_MAX, INT32_MIN, rng.randrange(P)])
        else:
            spec = 0
            value = ["rel", rng.choice([-2, -1, 1, 2, P])] if rng.random() < 0.5 else \
                rng.choice([-1, P + 1, INT64_MAX, INT64_MIN, 2**32])
        u = rng.random()
        inv = "none" if u < 0.6 else "all" if u < 0.9 else "rows"
        if cfg.get("contract"):
            inv = "all" if u < 0.7 else "rows"
        return [kind, rng.choice(["turns", "turns", "repeat", "bstep"]), rng.randrange(8), rng.randrange(16),
                field, spec, value, inv, rng.randint(1, 4)]
    if kind == "group":
        return [kind, [_pages(rng, cfg, rng.randint(0, 3)) for _ in range(rng.randint(1, 3))], rng.random() < 0.3,
                rng.choice([1, 2, 4, 4096])]
    if kind in ("snap", "restore"):
        return [kind, rng.randrange(2)]
    return [kind]


# ------------------------------------------------------------------ output checks
def _need(cond, what):
    if not cond:
        raise Violation(what)


def check_range(t, lo, hi, what):
    v = t.tolist()
    bad = [x for x in v if not lo <= x < hi]
    _need(not bad, f"{what}: values outside [{lo}, {hi}): {bad[:8]} (all: {v[:40]})")


def check_indptr(indptr, limit, what, prefix=None):
    v = indptr.tolist() if prefix is None else indptr.tolist()[:prefix]
    _need(v[0] == 0, f"{what}: starts at {v[0]}, not 0 ({v[:40]})")
    _need(all(a <= b for a, b in zip(v, v[1:])), f"{what}: decreasing ({v[:40]})")
    _need(v[-1] <= limit, f"{what}: ends at {v[-1]} past {limit} ({v[:40]})")


def check_csr(csr, B, P, ps, what, kv_lens=None, MP=None):
    cap = csr.indices.numel()
    check_indptr(csr.indptr, cap, what + ".indptr")
    ip = csr.indptr.tolist()
    ind = csr.indices.tolist()
    n = ip[B] if B < len(ip) else ip[-1]
    bad = [x for x in ind[:n] if not 0 <= x < P]
    _need(not bad, f"{what}.indices[:indptr[B]={n}] outside [0, {P}): {bad[:8]} (indices {ind[:40]})")
    tail = [x for x in ind[n:] if x != -1] if CHECK_PADDING else []
    _need(not tail, f"{what}.indices past indptr[B]={n} not -1: {tail[:8]} (indices {ind[:40]})")
    check_range(csr.last_page_len, 1, ps + 1, what + ".last_page_len")
    if kv_lens is not None:
        kv = kv_lens.tolist()
        _need(all(0 <= x <= MP * ps for x in kv), f"{what}: kv_lens outside [0, {MP * ps}]: {kv}")
        for i, x in enumerate(kv):
            pages = ip[i + 1] - ip[i]
            _need(x <= pages * ps, f"{what}: kv_lens[{i}] = {x} tokens but its CSR run has {pages} pages of {ps} "
                                   f"(a reader bounded by kv_lens reads past the run): kv_lens {kv}, indptr {ip}")


def check_step(r, cfg, B, T):
    P, ps, MP = cfg["num_pages"], cfg["page_size"], cfg["max_pages"]
    check_range(r.slots, -1, P * ps, "step.slots")
    check_range(r.positions, -1, MP * ps, "step.positions")
    check_indptr(r.qo_indptr, T, "step.qo_indptr")
    check_csr(r.csr, B, P, ps, "step.csr", r.kv_lens, MP)
    s, pos = r.slots.tolist(), r.positions.tolist()
    _need(all((a < 0) == (b < 0) for a, b in zip(s, pos)),
          f"step: slots and positions -1 at different places: {s} {pos}")


# ------------------------------------------------------------------ execution
def _apply_value(old, value, lo, hi):
    if isinstance(value, list):  # ["rel", delta]
        value = old + value[1]
    return max(lo, min(hi, value))


class System:
    """One pool and table and the long-lived objects the ops refer to (outs, bindings, snapshots)."""

    def __init__(self, cfg: dict, backend: str):
        import tpool
        self.tpool, self.cfg, self.backend = tpool, cfg, backend
        self.pool = tpool.PagePool(cfg["num_pages"], cfg["page_size"], device="cpu", backend=backend,
                                   max_batch=cfg["max_batch"])
        self.table = tpool.PageTable(self.pool, cfg["max_requests"], cfg["max_pages"], max_shapes=cfg["max_shapes"])
        self.aouts = {}
        self.bound_allocs = {}
        self.bound_frees = {}
        self.outs = {}
        self.turn = {}
        self.turn_ids = {}
        self.repeat = {}
        self.bsteps = {}
        self.snaps = {}

    # tensors
    @staticmethod
    def t(v):
        import torch
        return torch.tensor(v, dtype=torch.int32)

    def memos(self):
        return self.table._shapes.memo_list()

    def apply(self, op):
        """Run ``op``; raises Violation on an output out of bounds, lets unexpected exceptions through."""
        tp, pool, table, cfg = self.tpool, self.pool, self.table, self.cfg
        P, ps, R, MP = cfg["num_pages"], cfg["page_size"], cfg["max_requests"], cfg["max_pages"]
        kind = op[0]
        try:
            if kind == "alloc":
                _, counts, mode, evict, which = op
                if mode == "plain":
                    r = pool.alloc(self.t(counts), evict=evict)
                elif mode == "out":
                    out = self.aouts.get(which)
                    if out is None:
                        out = self.aouts[which] = pool.alloc_out(max_batch=min(cfg["max_batch"], 4 + which),
                                                                 max_pages=max(1, P - which))
                    r = pool.alloc(self.t(counts), out=out, evict=evict)
                else:
                    key = (len(counts), which, evict)
                    if key not in self.bound_allocs:
                        out = self.aouts.get(which)
                        if out is None:
                            out = self.aouts[which] = pool.alloc_out(max_batch=min(cfg["max_batch"], 4 + which),
                                                                     max_pages=max(1, P - which))
                        c = self.t([0] * len(counts))
                        self.bound_allocs[key] = (c, pool.bind_alloc(c, out=out, evict=evict))
                    c, run = self.bound_allocs[key]
                    c[:] = self.t(counts) if counts else c
                    r = run()
                check_range(r.pages, -1, P, "alloc.pages")
                check_range(r.evicted, -1, P, "alloc.evicted")
                check_indptr(r.indptr, r.pages.numel(), "alloc.indptr")
            elif kind == "free":
                _, pages, cache, mode = op
                if mode == "plain":
                    pool.free(self.t(pages), cache=cache)
                else:
                    key = (len(pages), cache)
                    if key not in self.bound_frees:
                        x = self.t([-1] * len(pages))
                        self.bound_frees[key] = (x, pool.bind_free(x, cache=cache))
                    x, run = self.bound_frees[key]
                    if pages:
                        x[:] = self.t(pages)
                    run()
            elif kind == "incref":
                pool.incref(self.t(op[1]))
            elif kind == "touch":
                pool.touch(self.t(op[1]))
            elif kind == "evict":
                _, k, use_out = op
                if use_out:
                    import torch
                    out = torch.full((k,), 7, dtype=torch.int32)
                    res = pool.evict(k, out=out)
                else:
                    res = pool.evict(k)
                check_range(res, -1, P, "evict")
            elif kind == "extend":
                _, ids, ntok, T = op
                r = table.extend(self.t(ids), self.t(ntok), max_tokens=T)
                check_range(r.slots, -1, P * ps, "extend.slots")
            elif kind == "step":
                _, ids, ntok, T, cap, rel, rc = op
                kw = {}
                if rel is not None:
                    kw = dict(release=self.t(rel), release_cache=rc)
                r = table.step(self.t(ids), self.t(ntok), max_tokens=T, capacity=cap, **kw)
                check_step(r, cfg, len(ids), r.slots.numel())
            elif kind == "turns":
                _, ids, ntok, T, cap, n = op
                B = len(ntok)
                key = (B, T, cap)
                if key not in self.outs:
                    self.outs[key] = [table.step_out(B, max_tokens=T, capacity=cap) for _ in range(2)]
                    self.turn[key] = 0
                    self.turn_ids[key] = [-1] * B
                if ids is None:
                    ids = self.turn_ids[key]
                self.turn_ids[key] = ids
                tids = self.t(ids)
                for j in range(n):
                    out = self.outs[key][self.turn[key]]
                    self.turn[key] ^= 1
                    r = table.step(tids, self.t(ntok if j == 0 else [1] * B), out=out)
                    check_step(r, cfg, B, T)
            elif kind == "repeat":
                _, ids, ntok, n, fresh = op
                B = len(ntok)
                if B not in self.repeat or fresh:
                    self.repeat[B] = (self.t([-1] * B), self.t([0] * B))
                a, c = self.repeat[B]
                if ids is not None:
                    a[:] = self.t(ids)
                for j in range(n):
                    c[:] = self.t(ntok if j == 0 else [1] * B)
                    r = table.step(a, c)
                    check_step(r, cfg, B, B)
            elif kind == "bstep":
                _, B, T, cap, K, fixed, use_out, rc, ids, ntok, rel, n = op
                key = (B, T, cap, K, fixed, use_out, rc)
                if key not in self.bsteps:
                    out = None
                    if use_out:
                        out = table.step_out(B, max_tokens=T, capacity=cap)
                    if fixed:
                        run = table.bind_step(batch=B, max_tokens=T, capacity=cap, release=K, release_cache=rc,
                                              out=out)
                    else:
                        rel_t = None if K is None else self.t([-1] * K)
                        run = table.bind_step(self.t([-1] * B), self.t([0] * B), max_tokens=T, capacity=cap,
                                              release=rel_t, release_cache=rc, out=out)
                    self.bsteps[key] = run
                run = self.bsteps[key]
                for j in range(n):
                    if fixed:
                        if ids is not None:
                            run.req_ids[:] = ids
                        run.num_tokens[:] = ntok if j == 0 else [1] * B
                        if K is not None and j == 0 and rel is not None:
                            run.release[:] = rel
                    else:
                        if ids is not None:
                            run.req_ids[:] = self.t(ids)
                        run.num_tokens[:] = self.t(ntok if j == 0 else [1] * B)
                        if K is not None and j == 0 and rel is not None:
                            run.release[:] = self.t(rel)
                    r = run()
                    check_step(r, cfg, B, T)
                    if K is not None:
                        rl = run.release.tolist()
                        _need(all(x == -1 for x in rl), f"bound step: release ids not consumed: {rl}")
            elif kind == "fork":
                _, src, dst, lens = op
                r = table.fork(self.t(src), self.t(dst), self.t(lens))
                check_range(r.cow_src, -1, P, "fork.cow_src")
                check_range(r.cow_dst, -1, P, "fork.cow_dst")
                a, b = r.cow_src.tolist(), r.cow_dst.tolist()
                _need(all((x < 0) == (y < 0) for x, y in zip(a, b)), f"fork: half a copy pair: {a} {b}")
            elif kind == "revive":
                pages, gens = self.t(op[2]), op[4] if len(op) > 4 else None  # (findings from before: no generations)
                gens = pool.generations(pages) if gens == "own" else None if gens is None else self.t(gens)
                table.revive(op[1], pages, op[3], generations=gens)
            elif kind == "truncate":
                _, ids, lens, drop = op
                if drop:
                    table.truncate(self.t(ids), drop=self.t(lens))
                else:
                    table.truncate(self.t(ids), self.t(lens))
            elif kind == "release":
                table.release(self.t(op[1]), cache=op[2])
            elif kind == "csr":
                _, ids, cap = op
                csr = table.flashinfer_csr(self.t(ids), capacity=cap)
                check_csr(csr, len(ids), P, ps, "csr")
            elif kind == "rows":
                ids = op[1]
                rows = table.block_table_rows(self.t(ids))
                _need(tuple(rows.shape) == (len(ids), MP), f"rows: shape {tuple(rows.shape)}")
                for i, r in enumerate(ids):
                    if not 0 <= r < R:
                        _need(all(x == -1 for x in rows[i].tolist()), f"rows: row of bad id {r} not -1")
            elif kind == "invalidate":
                table.invalidate_csr(None if op[1] is None else self.t(op[1]))
            elif kind == "edit":
                self.edit(op)
            elif kind == "poke":
                self.poke(op)
            elif kind == "memo":
                _, which, at, value = op
                memos = self.memos()
                if memos:
                    m = memos[which % len(memos)].tensor
                    i = at % m.numel()
                    m[i] = _apply_value(int(m[i]), value, INT64_MIN, INT64_MAX)
            elif kind == "check":
                try:
                    pool.check()
                except tp.PoolError:
                    pass
            elif kind == "invariants":
                try:
                    table.check_invariants(exclusive=False)
                except tp.InvariantViolation:
                    pass
            elif kind == "stats":
                pool.stats()
                pool.available()
                pool.stats_async().get()
            elif kind == "group":
                _, lists, cache, capacity = op
                with pool.free_group(capacity):
                    for pages in lists:
                        pool.free(self.t(pages), cache=cache)
            elif kind == "snap":
                from tpool.graphs import state_tensors
                self.snaps[op[1]] = [t.clone() for t in state_tensors(table)]
            elif kind == "restore":
                from tpool.graphs import state_tensors
                if op[1] in self.snaps:
                    for t, s in zip(state_tensors(table), self.snaps[op[1]], strict=True):
                        t.copy_(s)
            else:
                raise AssertionError(f"unknown op {kind}")
        except (ValueError, TypeError):
            return "refused"
        return "ok"

    def poke(self, op):
        """A hand edit of a row of a running decode batch (or of the stack top), then decode steps of that batch."""
        from tpool.kernels import layout as L
        _, loop, slot, lane, field, spec, value, inv, n = op
        pool, table, cfg = self.pool, self.table, self.cfg
        ps, P = cfg["page_size"], cfg["num_pages"]
        if loop == "turns":
            keys = sorted(self.turn_ids, key=str)
        elif loop == "repeat":
            keys = sorted(self.repeat)
        else:
            keys = sorted(self.bsteps, key=str)
        if not keys:
            return
        key = keys[slot % len(keys)]
        if loop == "turns":
            ids = self.turn_ids[key]
        elif loop == "repeat":
            ids = self.repeat[key][0].tolist()
        else:
            ids = [int(x) for x in self.bsteps[key].req_ids.tolist()]
        r = ids[lane % len(ids)]
        if field in ("seq_lens", "block_table") and not 0 <= r < cfg["max_requests"]:
            return
        if field == "seq_lens":
            table.seq_lens[r] = _apply_value(int(table.seq_lens[r]), value, INT32_MIN, INT32_MAX)
        elif field == "block_table":
            length = int(table.seq_lens[r])
            col = max(0, -(-length // ps) - 1 + spec) if length >= 0 else 0
            if col >= cfg["max_pages"]:
                return
            table.block_table[r, col] = value
        elif field == "free_stack":
            at = int(pool.state.counters[L.FREE_COUNT]) - 1 - spec
            if not 0 <= at < P:
                return
            pool.state.free_stack[at] = value
        else:
            pool.state.counters[L.FREE_COUNT] = _apply_value(int(pool.state.counters[L.FREE_COUNT]), value,
                                                             INT64_MIN, INT64_MAX)
        if inv == "all" or (inv == "rows" and field not in ("seq_lens", "block_table")):
            table.invalidate_csr()
        elif inv == "rows":
            table.invalidate_csr(self.t([r]))
        B = len(ids)
        for _ in range(n):  # decode steps of that batch
            if loop == "turns":
                out = self.outs[key][self.turn[key]]
                self.turn[key] ^= 1
                res = table.step(self.t(ids), self.t([1] * B), out=out)
                check_step(res, cfg, B, key[1])
            elif loop == "repeat":
                a, c = self.repeat[key]
                c[:] = 1
                res = table.step(a, c)
                check_step(res, cfg, B, B)
            else:
                run = self.bsteps[key]
                run.num_tokens[:] = 1
                res = run()
                check_step(res, cfg, B, key[1])

    def edit(self, op):
        _, edits, inv, rows = op
        pool, table = self.pool, self.table
        for owner, name, at, value, _unused in edits:
            if owner == "table" and name == "copyrow":  # row ``at`` copied into row ``value``
                table.block_table[value].copy_(table.block_table[at])
                continue
            if owner == "table" and name == "memo_version":
                from tpool.kernels import layout as L
                held = [int(m.tensor[L.MEMO_VERSION]) for m in self.memos()]
                held = [v for v in held if v >= 0]
                if held:
                    table.state.version[at] = held[value % len(held)]
                continue
            st = pool.state if owner == "pool" else table.state
            t = getattr(st, name).view(-1)
            if at >= t.numel():
                continue
            lo, hi = {"torch.int8": (-128, 127), "torch.int32": (INT32_MIN, INT32_MAX),
                      "torch.int64": (INT64_MIN, INT64_MAX)}[str(t.dtype)]
            t[at] = _apply_value(int(t[at]), value, lo, hi)
        if inv == "all":
            table.invalidate_csr()
        elif inv == "rows" and rows:
            table.invalidate_csr(self.t(rows))


def run_episode(cfg, ops, backend, log=None):
    """Replay ``ops`` on a fresh system. Returns None, or ``(index, kind, message, traceback)`` of the first finding."""
    import tpool
    sysm = System(cfg, backend)
    for k, op in enumerate(ops):
        try:
            sysm.apply(op)
        except Violation as e:
            return k, "Violation", str(e), ""
        except tpool.PoolError as e:  # only check() may raise these: anywhere else a finding
            return k, type(e).__name__, str(e), traceback.format_exc(limit=-6)
        except Exception as e:  # noqa: BLE001 - every other exception is a finding
            return k, type(e).__name__, str(e), traceback.format_exc(limit=-6)
        if _GUARDED and (bad := overwritten_guards()):
            return k, "Violation", f"bytes written beside a tpool allocation (size, guard before, after): {bad}", ""
    return None


def same_finding(a, b):
    return a is not None and b is not None and a[1] == b[1] and a[2].split(":")[0] == b[2].split(":")[0]


def shrink(cfg, ops, backend, want):
    """Delta debugging over the op list (and then over each op's lists) while the finding stays."""
    def fails(trial):
        got = run_episode(cfg, trial, backend)
        return got is not None and same_finding(got, want) and got[0] == len(trial) - 1

    ops = list(ops)
    n = 2
    while len(ops) >= 2:
        chunk = max(len(ops) // n, 1)
        for start in range(0, len(ops) - 1, chunk):  # the failing (last) op stays
            trial = ops[:start] + ops[min(start + chunk, len(ops) - 1):]
            if len(trial) < len(ops) and fails(trial):
                ops, n = trial, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(n * 2, len(ops))
    # drop single edits inside edit ops, and trailing lanes
    for i in range(len(ops)):
        if ops[i][0] == "edit" and len(ops[i][1]) > 1:
            for j in range(len(ops[i][1]) - 1, -1, -1):
                e = ops[i][1]
                trial_op = [ops[i][0], e[:j] + e[j + 1:], *ops[i][2:]]
                trial = ops[:i] + [trial_op] + ops[i + 1:]
                if trial_op[1] and fails(trial):
                    ops = trial
        if ops[i][0] == "edit" and ops[i][2] != "none":
            trial = ops[:i] + [[ops[i][0], ops[i][1], "none", ops[i][3]]] + ops[i + 1:]
            if fails(trial):
                ops = trial
    return ops


# ------------------------------------------------------------------ raw-memory checks
REGISTRY_ADDR = 0x6F5A00000000  # (any address no process maps by itself)


def _fixed_registry(n):
    """int64 ``[n]`` zeros at ``REGISTRY_ADDR`` (an anonymous mapping placed there)."""
    import ctypes
    import mmap

    import numpy as np
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = -(-8 * n // mmap.PAGESIZE) * mmap.PAGESIZE
    MAP_FIXED_NOREPLACE = 0x100000
    got = libc.mmap(REGISTRY_ADDR, size, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
    if got != REGISTRY_ADDR:
        raise RuntimeError(f"fuzz raw check: could not map the registry at {REGISTRY_ADDR:#x} (got {got}, "
                           f"errno {ctypes.get_errno()}); run with --no-raw-check")
    return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(REGISTRY_ADDR))


def guarded_full(shape, fill, np_dtype):
    """``np.full(shape, fill)`` inside a larger allocation: ``CANARY`` guard bytes before and after it
    (``GUARD_BYTE``), checked by :func:`overwritten_guards`. The array is a view that keeps it alive."""
    import weakref

    import numpy as np
    dims = shape if isinstance(shape, tuple) else (shape,)
    itemsize = np.dtype(np_dtype).itemsize
    nbytes = itemsize * int(np.prod(dims, dtype=np.int64))
    raw = np.full(nbytes + 2 * CANARY, GUARD_BYTE, np.uint8)
    arr = raw[CANARY:CANARY + nbytes].view(np_dtype).reshape(dims)
    arr[...] = fill
    _GUARDED.append(weakref.ref(raw))
    return arr


def overwritten_guards() -> list:
    """``(bytes of the allocation, guard before, guard after)`` (hex) of every live guarded allocation whose
    guard bytes changed since the last check (they are then restored, so each write is reported once)."""
    live, bad = [], []
    for ref in _GUARDED:
        raw = ref()
        if raw is None:
            continue
        live.append(ref)
        before, after = raw[:CANARY], raw[raw.size - CANARY:]
        if (before != GUARD_BYTE).any() or (after != GUARD_BYTE).any():
            bad.append((raw.size - 2 * CANARY, before.tobytes().hex(), after.tobytes().hex()))
            before[:] = GUARD_BYTE
            after[:] = GUARD_BYTE
    _GUARDED[:] = live
    return bad


def install_canaries():
    """Make tpool's CPU ``fixed_full`` allocations guarded (:func:`guarded_full`); the raw checks' version
    (:func:`install_raw_checks`, installed first) guards its allocations itself. Before any pool is made."""
    import torch

    import tpool.state
    current = tpool.state.fixed_full
    if getattr(current, "guarded", False):
        return
    np_dtypes = tpool.state._NUMPY_DTYPES

    def fixed_full(shape, fill, dtype, device):
        if torch.device(device).type != "cpu":
            return current(shape, fill, dtype, device)
        with torch.inference_mode(False):
            return torch.from_numpy(guarded_full(shape, fill, np_dtypes[dtype]))

    fixed_full.guarded = True
    for name, mod in list(sys.modules.items()):
        if name.startswith("tpool") and getattr(mod, "fixed_full", None) is current:
            mod.fixed_full = fixed_full


def install_raw_checks(canary=False):
    """Replace the kernels' raw-memory helpers with checked twins (module note). Call before any
    kernel is compiled (it patches module globals that numba reads at compile time)."""
    import weakref

    import numba
    import numpy as np
    import torch

    import tpool.state
    from tpool.kernels import _numba_util as nu
    from tpool.kernels import (alloc, block_table_rows, evict, extend, flashinfer_csr, fork, free, incref, release,
                               revive, step, touch)

    cap = 1 << 16
    # [count, lo0, hi0, lo1, hi1, ...]: byte ranges of live allocations. Kept at a fixed address, because
    # the checked helpers compile it in as a constant and numba caches the kernels across processes.
    reg = _fixed_registry(1 + 2 * cap)
    reg_addr = reg.ctypes.data
    where = {}

    def add(lo, hi):
        n = int(reg[0])
        if n >= cap:
            return
        reg[1 + 2 * n], reg[2 + 2 * n] = lo, hi
        where[lo] = n
        reg[0] = n + 1

    def drop(lo):
        j = where.pop(lo, None)
        if j is None:
            return
        n = int(reg[0]) - 1
        if j != n:
            reg[1 + 2 * j], reg[2 + 2 * j] = reg[1 + 2 * n], reg[2 + 2 * n]
            where[int(reg[1 + 2 * j])] = j
        reg[0] = n

    original = tpool.state.fixed_full
    np_dtypes = tpool.state._NUMPY_DTYPES

    def fixed_full(shape, fill, dtype, device):
        if torch.device(device).type != "cpu":
            return original(shape, fill, dtype, device)
        # as tpool.state.fixed_full, its range registered (and guarded, with canary)
        arr = guarded_full(shape, fill, np_dtypes[dtype]) if canary else np.full(shape, fill, dtype=np_dtypes[dtype])
        if arr.nbytes > 0:
            lo = arr.ctypes.data
            if lo in where:  # a stale entry (finalizers drop them first: should not happen)
                drop(lo)
            add(lo, lo + arr.nbytes)
            weakref.finalize(arr, drop, lo)  # torch.from_numpy holds arr as long as the storage lives
        return torch.from_numpy(arr)

    fixed_full.guarded = canary
    for name, mod in list(sys.modules.items()):
        if name.startswith("tpool") and getattr(mod, "fixed_full", None) is original:
            mod.fixed_full = fixed_full

    i64p = nu._i64_ptr

    @numba.njit(inline="always")
    def range_ok(lo, nbytes):
        if nbytes < 0:
            return False
        if nbytes == 0:
            return True
        hi = lo + nbytes
        r = numba.carray(i64p(reg_addr), (1 + 2 * cap,))
        for j in range(r[0]):
            a, b = r[1 + 2 * j], r[2 + 2 * j]
            if lo < b and hi > a and not (lo >= a and hi <= b):
                return False
        return True

    orig_move, orig_copy, orig_fill = nu.move_i32, nu.copy_i32, nu.fill_null_i32
    i32p, u8p = nu._i32_ptr, nu._u8_ptr

    @numba.njit
    def move_i32(dst, src, n):
        if not range_ok(dst, 4 * n) or not range_ok(src, 4 * n):
            raise IndexError("fuzz raw check: move_i32 outside an allocation")
        orig_move(dst, src, n)

    @numba.njit
    def copy_i32(dst, src, n):
        if not range_ok(dst, 4 * n) or not range_ok(src, 4 * n):
            raise IndexError("fuzz raw check: copy_i32 outside an allocation")
        orig_copy(dst, src, n)

    @numba.njit
    def fill_null_i32(addr, n):
        if not range_ok(addr, 4 * n):
            raise IndexError("fuzz raw check: fill_null_i32 outside an allocation")
        orig_fill(addr, n)

    @numba.njit(inline="always")
    def i32_array(addr, n):
        if not range_ok(addr, 4 * n):
            raise IndexError("fuzz raw check: i32_array outside an allocation")
        return numba.carray(i32p(addr), (n,))

    @numba.njit(inline="always")
    def u8_array(addr, n):
        if not range_ok(addr, n):
            raise IndexError("fuzz raw check: u8_array outside an allocation")
        return numba.carray(u8p(addr), (n,))

    @numba.njit(inline="always")
    def i64_array(addr, n):
        if not range_ok(addr, 8 * n):
            raise IndexError("fuzz raw check: i64_array outside an allocation")
        return numba.carray(i64p(addr), (n,))

    @numba.njit(inline="always")
    def i64_cell(addr):
        if not range_ok(addr, 8):
            raise IndexError("fuzz raw check: i64_cell outside an allocation")
        return numba.carray(i64p(addr), (1,))

    repl = dict(move_i32=move_i32, copy_i32=copy_i32, i32_array=i32_array, u8_array=u8_array, i64_array=i64_array,
                i64_cell=i64_cell)
    for mod in (nu, alloc, block_table_rows, evict, extend, flashinfer_csr, fork, free, incref, release, revive, step,
                touch):
        for name, f in repl.items():
            if name in vars(mod):
                setattr(mod, name, f)
    nu.fill_null_i32 = fill_null_i32
    # the fixed tensors made before the patch: the version source (made at import of the numba backend)
    import tpool.backends.numba as nb
    vs = nb.VERSION_SOURCE
    add(vs.data_ptr(), vs.data_ptr() + 8)
    return reg


# ------------------------------------------------------------------ worker and parent
def fixed_episodes() -> list:
    """Hand-written episodes ``[(cfg, ops), ...]`` for edits a short random run rarely makes, run once
    before the seeds with ``--fixed``: every LRU-queue entry set to a page id just past the pool (P) or to
    -1, then the calls that read the queue (evict, touch, a free into the cache, an alloc that evicts).
    A queue check loosened to accept P read the page state one past its end, which only
    ``NUMBA_BOUNDSCHECK`` shows (a read: the canaries see only writes)."""
    from tpool.kernels import layout as L  # (constants only)
    cfg = dict(num_pages=4, page_size=1, max_requests=2, max_pages=2, max_batch=4, max_shapes=2, edit_weight=0,
               turns=[[1, 1, None], [1, 1, None]])
    P, out = cfg["num_pages"], []
    for value in (P, -1, P + 1):
        every = [["pool", "lru_queue", i, value, None] for i in range(L.LRU_FACTOR * P)]
        out.append((cfg, [["alloc", [P], "plain", False, 0], ["free", list(range(P)), True, "plain"],
                          ["edit", every, "none", []], ["touch", list(range(P)), False, "plain"],
                          ["evict", P, False], ["evict", 1, True], ["free", list(range(P)), True, "plain"],
                          ["alloc", [2], "plain", True, 0], ["check"], ["invariants"]]))
    return out


def seed_ops(seed, n_ops, memo_edits, opts=None):
    """The episodes of one seed: [(cfg, ops), ...] with n_ops operations in all."""
    rng = random.Random(seed)
    out, left = [], n_ops
    while left > 0:
        cfg = dict(gen_config(rng), **(opts or {}))
        n = min(left, rng.choice([OPS_PER_EPISODE, OPS_PER_EPISODE, 60, 400]))
        out.append((cfg, [gen_op(rng, cfg, memo_edits) for _ in range(n)]))
        left -= n
    return out


def tags(ops) -> list:
    """What kinds of state changes led to a finding (to tell findings apart)."""
    out = set()
    for op in ops:
        if op[0] == "edit":
            names = {e[1] for e in op[1]}
            if op[2] == "none":
                out.add("edit-without-invalidate")
            elif op[2] == "rows" and not all(e[0] == "table" and e[1] in ("seq_lens", "block_table", "copyrow")
                                             for e in op[1]):
                out.add("pool-edit-with-invalidate-rows")
            if names & {"version", "row_version", "memo_version"}:
                out.add("version-edit")
            if names & {"claim", "occur", "keys", "lane_end"}:
                out.add("scratch-edit")
        elif op[0] in ("memo", "restore"):
            out.add(op[0])
        elif op[0] == "poke" and op[7] == "none":
            out.add("edit-without-invalidate")
    return sorted(out)


def _setup(args):
    global CHECK_PADDING
    CHECK_PADDING = not args.memo_edits
    import torch
    torch.set_num_threads(1)
    if args.raw_check and args.backend == "numba":
        install_raw_checks(args.canary)
    if args.canary and args.backend == "numba":
        install_canaries()
    if args.backend == "triton":   # (the parent runs its workers with TRITON_INTERPRET=1)
        import triton_guard
        triton_guard.setup(args.block)


def _finding(args, seed, e, cfg, ops, bad) -> dict:
    """Write finding ``bad`` (``run_episode``'s) of episode ``e`` of ``seed`` (an int, or "fixed": the
    hand-written episodes) to ``--findings``; its summary."""
    k, kind, msg, tb = bad
    path = os.path.join(args.findings, f"{args.backend}_{'' if seed == 'fixed' else 'seed'}{seed}_ep{e}.json")
    with open(path, "w") as f:
        json.dump(dict(seed=seed, episode=e, cfg=cfg, ops=ops[:k + 1], kind=kind, message=msg, traceback=tb,
                       backend=args.backend, memo_edits=args.memo_edits, tags=tags(ops[:k + 1])), f)
    return dict(episode=e, op=k, kind=kind, message=msg[:300], file=path, opname=ops[k][0], tags=tags(ops[:k + 1]))


def worker(args) -> int:
    _setup(args)
    os.makedirs(args.findings, exist_ok=True)
    if args.fixed:
        print(json.dumps({"start": "fixed"}), flush=True)
        found, done = [], 0
        for e, (cfg, ops) in enumerate(fixed_episodes()):
            bad = run_episode(cfg, ops, args.backend)
            done += len(ops) if bad is None else bad[0] + 1
            if bad is not None:
                found.append(_finding(args, "fixed", e, cfg, ops, bad))
        print(json.dumps({"fixed": done, "findings": found}), flush=True)
    for seed in range(args.seed, args.seed + args.seeds):
        print(json.dumps({"start": seed}), flush=True)
        t0 = time.time()
        found = []
        done = 0
        opts = dict(contract=args.contract, no_version_edits=args.no_version_edits)
        for e, (cfg, ops) in enumerate(seed_ops(seed, args.ops, args.memo_edits and not args.contract, opts)):
            bad = run_episode(cfg, ops, args.backend)
            if bad is None:
                done += len(ops)
                continue
            done += bad[0] + 1
            found.append(_finding(args, seed, e, cfg, ops, bad))
        print(json.dumps({"seed": seed, "ops": done, "findings": found, "s": round(time.time() - t0, 2)}), flush=True)
    return 0


def replay(args) -> int:
    _setup(args)
    with open(args.replay) as f:
        rec = json.load(f)
    cfg, ops = rec["cfg"], rec["ops"]
    got = run_episode(cfg, ops, args.backend)
    print("replay:", got[:3] if got else None)
    if got and args.shrink:
        small = shrink(cfg, ops, args.backend, got)
        print(f"minimal ({len(small)} ops), cfg {cfg}:")
        for op in small:
            print("   ", json.dumps(op))
        print("   ->", run_episode(cfg, small, args.backend)[:3])
        out = args.replay.replace(".json", ".min.json")
        with open(out, "w") as f:
            json.dump(dict(rec, ops=small), f)
    return 1 if got else 0


def parent(args) -> int:
    env = dict(os.environ)
    if args.backend == "numba":
        env["NUMBA_BOUNDSCHECK"] = "1"
        env["NUMBA_CACHE_DIR"] = args.cache_dir + ("_raw" if args.raw_check else "")
    if args.backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    t0 = time.time()
    total_ops, fixed_ops, findings, crashes = 0, 0, [], []
    seed, end = args.seed, args.seed + args.seeds
    fixed = args.fixed  # (the first worker runs the hand-written episodes first; once, even if it crashes)
    while seed < end or fixed:
        k = min(args.batch, end - seed)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed", str(seed), "--seeds", str(k),
               "--ops", str(args.ops), "--backend", args.backend, "--findings", args.findings]
        if fixed:
            cmd.append("--fixed")
            fixed = False
        if not args.raw_check:
            cmd.append("--no-raw-check")
        if not args.canary:
            cmd.append("--no-canary")
        if args.memo_edits:
            cmd.append("--memo-edits")
        if args.contract:
            cmd.append("--contract")
        if args.no_version_edits:
            cmd.append("--no-version-edits")
        if args.block is not None:
            cmd += ["--block", str(args.block)]
        started, finished = None, set()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
                (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        for line in out.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "start" in rec:
                started = rec["start"]
            elif "fixed" in rec:
                finished.add("fixed")
                fixed_ops += rec["fixed"]
                for fnd in rec["findings"]:
                    findings.append(dict(fnd, seed="fixed"))
                    print(f"FINDING fixed ep {fnd['episode']} op {fnd['op']} ({fnd['opname']}): {fnd['kind']}: "
                          f"{fnd['message'][:200]}  [{fnd['file']}]", file=sys.stderr)
            elif "seed" in rec:
                finished.add(rec["seed"])
                total_ops += rec["ops"]
                for fnd in rec["findings"]:
                    findings.append(dict(fnd, seed=rec["seed"]))
                    print(f"FINDING seed {rec['seed']} ep {fnd['episode']} op {fnd['op']} ({fnd['opname']}) "
                          f"{fnd['tags']}: {fnd['kind']}: {fnd['message'][:200]}  [{fnd['file']}]", file=sys.stderr)
        if rc != 0:
            bad = started if started is not None and started not in finished else seed
            crashes.append(dict(seed=bad, rc=rc, stderr=err[-2000:]))
            print(f"CRASH/HANG seed {bad}: rc {rc}\n{err[-1500:]}", file=sys.stderr)
            seed = seed if bad == "fixed" else bad + 1  # (the seeds of a worker that crashed in the fixed ones again)
        else:
            seed += k
        print(f"[{time.time() - t0:7.1f}s] seeds {args.seed}..{seed - 1}: {total_ops} ops, {len(findings)} findings, "
              f"{len(crashes)} crashes", file=sys.stderr, flush=True)
    summary = dict(backend=args.backend, seeds=[args.seed, end - 1], ops=total_ops, fixed_ops=fixed_ops,
                   findings=len(findings),
                   crashes=crashes, seconds=round(time.time() - t0, 1), raw_check=args.raw_check,
                   canary=args.canary and args.backend == "numba",
                   memo_edits=args.memo_edits, contract=args.contract, no_version_edits=args.no_version_edits)
    print(json.dumps(summary))
    return 1 if findings or crashes else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000, help="operations per seed (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds to run, from --seed (default 1)")
    ap.add_argument("--backend", default="numba", choices=["numba", "reference", "triton"],
                    help="numba (default; bounds-checked), reference, or triton (interpreted, address-checked)")
    ap.add_argument("--block", type=int, default=None,
                    help="triton: lanes per chunk, a power of two (default: the kernels' own, 32 to 2048)")
    ap.add_argument("--batch", type=int, default=10, help="seeds per worker subprocess (default 10)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per worker subprocess (default 900)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE,
                    help=f"NUMBA_CACHE_DIR for the bounds-checked kernels (default {DEFAULT_CACHE}; "
                         "'_raw' appended with --raw-check)")
    ap.add_argument("--findings", default=DEFAULT_FINDINGS, help=f"where findings go (default {DEFAULT_FINDINGS})")
    ap.add_argument("--no-raw-check", dest="raw_check", action="store_false",
                    help="do not patch the raw-memory helpers with checked twins")
    ap.add_argument("--no-canary", dest="canary", action="store_false",
                    help="no guard bytes around tpool's allocations (numba; see the module note)")
    ap.add_argument("--memo-edits", action="store_true", help="also edit a step's CSR memo (outside the promise)")
    ap.add_argument("--contract", action="store_true",
                    help="follow every hand edit by invalidate_csr() (or invalidate_csr(rows) naming every row "
                         "edited), as the README asks")
    ap.add_argument("--no-version-edits", action="store_true",
                    help="no hand edits of the table's version cells and row stamps")
    ap.add_argument("--fixed", action="store_true",
                    help="first run the hand-written episodes (fixed_episodes: LRU-queue entries past the pool)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replay", help="replay a finding's JSON file in this process")
    ap.add_argument("--shrink", action="store_true", help="with --replay: shrink it to a minimal op list")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.replay:
        return replay(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
