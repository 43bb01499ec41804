"""Lockstep differential fuzzer: the same random calls on every backend, compared after each one.

Each episode builds one small pool and table per backend (same sizes), then runs
random operations on all of them in lockstep: valid calls (revives of pages in any state among
them, half of them with generations recorded when pages were last cached, so stale after evictions
and frees; bound steps that
release requests first among them, steps into two ``StepOut`` buffers taking turns,
mostly decoding the same batch, as overlap scheduling does, the first of a run sometimes releasing
requests first), misuse (bad and repeated ids, negative
counts, double frees), hand edits of the state followed by
``invalidate_csr()``, or for half the table edits ``invalidate_csr(row)`` (any value
into ``seq_lens``, ``block_table``, ``free_stack``, the free and cached counts and the
clock, the LRU queue's head, tail, hole and scan, ``refcount``, ``page_state``, ``stamp``, ``page_gen``, ``lru_queue``,
``lru_pos``, the pool's scratch ``claim`` and ``occur``, whose values must change no result, and
the table's ``claim``), and snapshot restores
(``tpool.graphs.state_tensors``). After every operation every output and every
state tensor (scratch excepted) must be equal on all backends (``torch.equal``);
an exception must be the same type on all of them.

A divergence is shrunk to a minimal operation list (delta debugging: drop chunks
of operations while the failure stays) and printed as a reproducer; the exit
status is 1. A crash (a kernel touching memory it was not given) kills the
process: run it in a subprocess, as ``tests/test_fuzz.py`` does. Interpreted Triton
(``TRITON_INTERPRET=1``) runs under ``tests/triton_guard.py``'s address check: a kernel's access
outside its tensors raises instead of reading host memory unseen. ``--block 4`` makes Triton's
kernels work in chunks of 4 lanes, so the fuzzer's small batches run their multi-chunk paths.

``--mix lru`` weights the operations towards the LRU queue (allocs that evict, frees and releases
into the cache, touches, revives, evictions) and adds ``shift``: the whole queue moved to other
positions with its order kept (head, hole, scan, tail and ``lru_pos`` by one amount, the ring rotated
to match), past int32 and near ``LRU_POS_LIMIT``, as a long-running pool holds it. ``--pages N`` fixes
every pool at ``N`` pages and lets half the batches name up to ``N + 2`` ids, so a call pushes many
entries and the cleaner reads long stretches.

Usage: ``python tests/fuzz_lockstep.py --ops 20000 --backends reference,numba --seed 0``
(``--help`` lists every option). Triton needs ``TRITON_INTERPRET=1`` without a GPU.
"""

import argparse
import os
import random
import sys
import time

import torch

from tpool.kernels import layout as L

OPS_PER_EPISODE = 150  # operations on one set of pools before a fresh one (default)
LRU_COUNTERS = (L.LRU_HEAD, L.LRU_TAIL, L.LRU_HOLE, L.LRU_SCAN)  # the queue's four positions
EDIT_COUNTERS = (L.FREE_COUNT, L.CACHED_COUNT, L.CLOCK, *LRU_COUNTERS)
EDIT_VALUES = (-10**9, -6, -2, -1, 0, 1, 2, 3, 5, 7, 10**6, 2**31 - 2, 2**31 - 1)
SCRATCH = {"keys", "lane_end", "version", "row_version"}  # per-backend scratch, not compared
POOL_SCRATCH = {"claim", "occur"}  # the pool's: not compared once an episode has edited them (Triton resets
#                                   a value left in claim, numba and the reference never read it)
BOUND_BATCH, BOUND_RELEASE, BOUND_TOKENS = 4, 3, 12  # the shape of the bound steps ("bstep") and StepOuts


# ------------------------------------------------------------------ generation
def episode_config(rng: random.Random) -> dict:
    return dict(num_pages=rng.choice([4, 6, 9, 16, 24]), page_size=rng.choice([1, 2, 3, 4]),
                max_requests=rng.choice([3, 4, 6]), max_pages=rng.choice([2, 3, 5]), max_batch=8)


def _ids(rng, cfg, b):
    R = cfg["max_requests"]
    return [rng.choice([-1, R, R + 3, -5] if rng.random() < 0.1 else range(R)) for _ in range(b)]


def _pages(rng, cfg, b):
    P = cfg["num_pages"]
    return [rng.choice([-1, P, P + 7, -3] if rng.random() < 0.1 else range(P)) for _ in range(b)]


def _counts(rng, b, hi):
    return [rng.choice([-1, -4]) if rng.random() < 0.05 else rng.randint(0, hi) for _ in range(b)]


KINDS = ("alloc", "free", "incref", "touch", "evict", "extend", "step", "csr", "rows", "release", "truncate", "fork",
         "edit", "snapshot", "restore", "alias", "bstep", "turns", "revive", "shift")
MIXES = {  # weights per kind, in KINDS order ("edit" is zeroed without edits)
    "all": (8, 8, 4, 3, 3, 12, 12, 5, 2, 6, 4, 6, 6, 2, 2, 2, 6, 8, 5, 0),
    # the LRU queue: pages cached, touched, revived and evicted, so the ring wraps and the cleaner runs
    "lru": (14, 14, 5, 12, 6, 6, 2, 0, 0, 8, 1, 1, 2, 1, 1, 0, 2, 0, 5, 2),
}
# Where a "shift" moves the LRU queue's head: past int32, and near the position limit (layout.LRU_POS_LIMIT);
# rarely right below it, where the tail may pass the limit (the queue is then emptied, its cached pages
# left without entries: every later eviction of them is refused as corrupt_state)
SHIFT_TO = (2**31 - 3, 2**32 - 1, 2**40 + 7, 2**62 - 2**20)
SHIFT_PAST = 2**62 - 5


def gen_op(rng: random.Random, cfg: dict, edits: bool, mix: str = "all") -> tuple:
    """One operation as plain data (so a failing sequence prints as a reproducer)."""
    b = rng.randint(0, 5)
    P, R, MP = cfg["num_pages"], cfg["max_requests"], cfg["max_pages"]
    if cfg.get("wide") and rng.random() < 0.5:  # a batch of up to the pool's pages (a --pages run)
        b = rng.randint(0, P + 2)
    weights = [0 if k == "edit" and not edits else w for k, w in zip(KINDS, MIXES[mix])]
    kind = rng.choices(KINDS, weights=weights)[0]
    if kind == "shift":  # the whole queue moved to other positions (its order kept): a long-running pool
        return (kind, SHIFT_PAST if rng.random() < 0.05 else rng.choice(SHIFT_TO))
    if kind == "bstep":  # a bound step (table-made inputs, BOUND_RELEASE release lanes), filled, then run
        return (kind, _ids(rng, cfg, BOUND_BATCH), _counts(rng, BOUND_BATCH, rng.choice([1, 1, 3])),
                _ids(rng, cfg, BOUND_RELEASE) if rng.random() < 0.5 else [-1] * BOUND_RELEASE, rng.random() < 0.4)
    if kind == "turns":  # 1-4 steps, each into the next of two StepOuts; None: the last batch again, decoding
        k = rng.randint(1, 4)
        if rng.random() < 0.7:
            return (kind, None, None, k)
        op = (kind, _ids(rng, cfg, BOUND_BATCH), _counts(rng, BOUND_BATCH, rng.choice([1, 1, 3])), k)
        if rng.random() < 0.3:  # the first step releases finished requests first (out= and release= together)
            op += (_ids(rng, cfg, rng.randint(0, 3)), rng.random() < 0.4)
        return op
    if kind == "alloc":
        return (kind, _counts(rng, b, 3), rng.random() < (0.8 if mix == "lru" else 0.4))
    if kind in ("free", "incref", "touch"):
        return (kind, _pages(rng, cfg, b), rng.random() < (0.8 if mix == "lru" else 0.4))
    if kind == "evict":
        return (kind, rng.randint(0, P + 2))
    if kind in ("extend", "step"):
        ntok = _counts(rng, b, rng.choice([1, 1, 3, 7]))
        op = (kind, _ids(rng, cfg, b), ntok, max(sum(max(n, 0) for n in ntok), 1) + rng.randint(-2, 2))
        if kind == "step":  # a CSR capacity: the default (always enough), or one that may be too small
            op += (None if rng.random() < 0.7 else rng.randint(0, b * MP + 2),)
            if rng.random() < 0.3:  # finished requests released in the same call
                op += (_ids(rng, cfg, rng.randint(0, 3)), rng.random() < 0.4)
        return op
    if kind in ("csr", "rows"):
        return (kind, _ids(rng, cfg, b), rng.randint(0, b * MP + 2))
    if kind == "release":
        return (kind, _ids(rng, cfg, b), rng.random() < (0.8 if mix == "lru" else 0.4))
    if kind == "truncate":
        # absolute lengths, or tokens to drop from each request's end (speculative decoding)
        return (kind, _ids(rng, cfg, b), [rng.randint(-1, MP * cfg["page_size"]) for _ in range(b)], rng.random() < 0.5)
    if kind == "revive":  # a row (rarely out of range or not empty), k pages, and whole pages' tokens (or not),
        # and half the time the generations recorded when pages were last cached (System.recorded)
        k, ps = rng.randint(0, MP + (rng.random() < 0.1)), cfg["page_size"]
        n = k * ps if rng.random() < 0.9 else k * ps + rng.choice([1, -1])
        return (kind, rng.randrange(R) if rng.random() < 0.9 else rng.choice([-1, R]), _pages(rng, cfg, k), n,
                rng.random() < 0.5)
    if kind == "fork":
        lens = [rng.randint(-1, MP * cfg["page_size"]) for _ in range(b)]
        return (kind, _ids(rng, cfg, b), _ids(rng, cfg, b), lens)
    if kind == "edit":
        name = rng.choice(["seq_lens", "block_table", "free_stack", "counters", "refcount", "page_state", "stamp",
                           "page_gen", "lru_queue", "lru_pos", "claim", "occur", "table_claim"])
        size = {"seq_lens": R, "block_table": R * MP, "free_stack": P, "refcount": P, "page_state": P,
                "stamp": P, "page_gen": P, "counters": len(EDIT_COUNTERS), "lru_queue": 4 * P, "lru_pos": P,
                "claim": P, "occur": P, "table_claim": R}[name]
        value = rng.choice(EDIT_VALUES + tuple(range(-1, P + 2)))
        if name == "stamp":
            value = rng.choice([-2**62, -1, 0, 1, 5, 40, 2**62])
        if name == "page_state":
            value = rng.choice([0, 1, 2, 0, 1, 2, 5, -1])
        if name == "counters" and rng.random() < 0.3:  # around the LRU queue's room and its position limit
            value = rng.choice([2 * P, 3 * P, 3 * P + 1, 4 * P, 4 * P + 1, 2**62, 2**62 + 1])
        at = rng.randrange(size)
        # a clock about to wrap
        if mix == "lru" and name == "counters" and EDIT_COUNTERS[at] == L.CLOCK and rng.random() < 0.3:
            value = rng.choice([2**63 - 1, 2**63 - 2, -2**63])
        return (kind, name, at, value)
    if kind == "alias":
        return (kind, rng.randrange(len(ALIASES)))
    return (kind, rng.randrange(2))


# Aliasing attempts: an input that shares memory with what the call writes. Every backend must
# refuse it (ValueError) before touching anything; the state comparison after the op checks that.
ALIASES = (
    lambda pool, table, out: pool.free(pool.state.free_stack[:2]),
    lambda pool, table, out: pool.incref(pool.state.refcount[:1]),
    lambda pool, table, out: pool.alloc(out.indptr[:2], out=out),
    lambda pool, table, out: table.extend(i32([0, 1]), table.seq_lens[:2]),
    lambda pool, table, out: table.step(i32([0]), table.step(i32([0]), i32([0])).slots[:1]),
    lambda pool, table, out: table.fork(i32([0]), table.fork(i32([-1]), i32([-1]), i32([0])).cow_dst, i32([0])),
    lambda pool, table, out: table.flashinfer_csr(table.block_table[0, :1]),
    lambda pool, table, out: table.release(table.seq_lens[:1]),
    lambda pool, table, out: table.step(i32([0]), i32([1]), release=table.seq_lens[:1]),
    lambda pool, table, out: table.revive(0, table.block_table[1, :1], pool.page_size),
)


# ------------------------------------------------------------------ execution
def i32(v):
    return torch.tensor(v, dtype=torch.int32)


class System:
    """One backend's pool and table, and its snapshots."""

    def __init__(self, backend: str, cfg: dict):
        import tpool
        self.pool = tpool.PagePool(cfg["num_pages"], cfg["page_size"], device="cpu", backend=backend,
                                   max_batch=cfg["max_batch"])
        self.table = tpool.PageTable(self.pool, cfg["max_requests"], cfg["max_pages"])
        self.alloc_out = self.pool.alloc_out(max_batch=2, max_pages=cfg["num_pages"])  # for aliasing attempts
        self.snaps = {}
        self.bound = {cache: self.table.bind_step(batch=BOUND_BATCH, max_tokens=BOUND_TOKENS, release=BOUND_RELEASE,
                                                  release_cache=cache) for cache in (False, True)}
        self.outs = [self.table.step_out(BOUND_BATCH, max_tokens=BOUND_TOKENS) for _ in range(2)]
        self.turn, self.turn_ids = 0, [-1] * BOUND_BATCH  # the next StepOut, the last batch stepped into one
        self.recorded = None  # every page's generation when pages were last cached (a prefix cache's entries)
        self.scratch_edited = False  # the pool's claim or occur edited in this episode: not compared from then on

    def record(self):
        """Note every page's generation, as a prefix cache records them with the entries it makes."""
        self.recorded = self.pool.generations(torch.arange(self.pool.num_pages, dtype=torch.int32))

    def recorded_for(self, pages):
        """The generations recorded for ``pages`` (int32), -1 for ids outside the pool; the current ones
        when nothing was cached yet."""
        if self.recorded is None:
            return self.pool.generations(pages)
        P = self.pool.num_pages
        inside = (pages >= 0) & (pages < P)
        return torch.where(inside, self.recorded[pages.long().clamp(0, P - 1)], -1).to(torch.int32)

    def state(self) -> dict:
        out = {}
        for prefix, st in (("pool.", self.pool.state), ("table.", self.table.state)):
            for name, t in st.tensors().items():
                if name not in SCRATCH and not (self.scratch_edited and prefix == "pool." and name in POOL_SCRATCH):
                    out[prefix + name] = t
        return out

    def apply(self, op) -> list:
        """Run ``op``; returns its outputs (cloned) or the exception's type name."""
        from tpool.graphs import state_tensors
        kind, pool, table = op[0], self.pool, self.table
        try:
            if kind == "alloc":
                r = pool.alloc(i32(op[1]), evict=op[2])
                return [t.clone() for t in r]
            if kind == "free":
                pool.free(i32(op[1]), cache=op[2])
                if op[2]:
                    self.record()
            elif kind == "incref":
                pool.incref(i32(op[1]))
            elif kind == "touch":
                pool.touch(i32(op[1]))
            elif kind == "evict":
                return [pool.evict(op[1]).clone()]
            elif kind == "extend":
                return [t.clone() for t in table.extend(i32(op[1]), i32(op[2]), max_tokens=op[3])]
            elif kind == "bstep":
                run = self.bound[op[4]]
                run.req_ids[:], run.num_tokens[:], run.release[:] = op[1], op[2], op[3]
                r = run()
                outs = [t.clone() for t in (r.slots, r.ok, *r.csr, *r.metadata)]
                return outs + [torch.from_numpy(run.release.copy())]  # consumed: -1 on every backend
            elif kind == "turns":  # the first step as given, the others decode the same batch
                ids, ntok = (self.turn_ids, [1] * BOUND_BATCH) if op[1] is None else op[1:3]
                outs = []
                for j in range(op[3]):
                    out, self.turn, self.turn_ids = self.outs[self.turn], 1 - self.turn, ids
                    gone = dict(release=i32(op[4]), release_cache=op[5]) if j == 0 and len(op) > 4 else {}
                    r = table.step(i32(ids), i32(ntok if j == 0 else [1] * BOUND_BATCH), out=out, **gone)
                    outs += [t.clone() for t in (r.slots, r.ok, *r.csr, *r.metadata)]
                return outs
            elif kind == "step":
                gone = dict(release=i32(op[5]), release_cache=op[6]) if len(op) > 5 else {}
                r = table.step(i32(op[1]), i32(op[2]), max_tokens=op[3], capacity=op[4], **gone)
                return [t.clone() for t in (r.slots, r.ok, *r.csr, *r.metadata)]
            elif kind == "csr":
                return [t.clone() for t in table.flashinfer_csr(i32(op[1]), capacity=op[2])]
            elif kind == "rows":
                return [table.block_table_rows(i32(op[1])).clone()]
            elif kind == "release":
                table.release(i32(op[1]), cache=op[2])
                if op[2]:
                    self.record()
            elif kind == "truncate":
                if op[3]:
                    table.truncate(i32(op[1]), drop=i32(op[2]))
                else:
                    table.truncate(i32(op[1]), i32(op[2]))
            elif kind == "fork":
                return [t.clone() for t in table.fork(i32(op[1]), i32(op[2]), i32(op[3]))]
            elif kind == "revive":
                pages = i32(op[2])
                table.revive(op[1], pages, op[3], generations=self.recorded_for(pages) if op[4] else None)
            elif kind == "edit":
                _, name, at, value = op
                t = {"seq_lens": table.seq_lens, "block_table": table.block_table.view(-1),
                     "free_stack": pool.state.free_stack, "refcount": pool.state.refcount,
                     "page_state": pool.state.page_state, "stamp": pool.state.stamp,
                     "page_gen": pool.state.page_gen, "counters": pool.state.counters,
                     "lru_queue": pool.state.lru_queue, "lru_pos": pool.state.lru_pos, "claim": pool.state.claim,
                     "occur": pool.state.occur, "table_claim": table.state.claim}[name]
                self.scratch_edited |= name in POOL_SCRATCH
                if name == "counters":
                    t[EDIT_COUNTERS[at]] = value
                else:
                    t[at] = value
                if name in ("seq_lens", "block_table") and at % 2 == 0:  # half the time: name the row edited
                    table.invalidate_csr(i32([at if name == "seq_lens" else at // table.max_pages]))
                else:
                    table.invalidate_csr()
            elif kind == "shift":  # head to op[1], every position moved by the same amount: the same queue
                st = pool.state
                delta = op[1] - int(st.counters[L.LRU_HEAD])
                st.counters[list(LRU_COUNTERS)] += delta
                st.lru_pos.add_(delta)
                st.lru_queue.copy_(torch.roll(st.lru_queue, delta % st.lru_queue.numel()))
                table.invalidate_csr()
            elif kind == "snapshot":
                self.snaps[op[1]] = [t.clone() for t in state_tensors(table)]
            elif kind == "alias":
                ALIASES[op[1]](pool, table, self.alloc_out)
            elif kind == "restore":
                if op[1] in self.snaps:
                    for t, s in zip(state_tensors(table), self.snaps[op[1]], strict=True):
                        t.copy_(s)
        except (ValueError, RuntimeError, TypeError) as e:  # the façade's checks: same on every backend
            return [type(e).__name__]
        return []


def run_ops(backends, cfg, ops):
    """Replay ``ops`` on fresh systems; returns None, or ``(index, message)`` of the first divergence."""
    systems = [System(b, cfg) for b in backends]
    for k, op in enumerate(ops):
        outs = [s.apply(op) for s in systems]
        ref = outs[0]
        for b, out in zip(backends[1:], outs[1:]):
            if len(out) != len(ref) or any(
                    (type(x) is not type(y)) or (x != y if isinstance(x, str) else not torch.equal(x, y))
                    for x, y in zip(ref, out)):
                return k, f"output of {op[0]} differs: {backends[0]} {ref} vs {b} {out}"
        want = systems[0].state()
        for b, s in zip(backends[1:], systems[1:]):
            for name, t in s.state().items():
                if not torch.equal(t, want[name]):
                    return k, (f"state {name} differs after {op[0]}: "
                               f"{backends[0]} {want[name].tolist()} vs {b} {t.tolist()}")
    return None


def shrink(backends, cfg, ops):
    """Delta debugging over the op list: the smallest sub-list (by chunk removal) that still diverges."""
    n = 2
    while len(ops) >= 2:
        chunk = max(len(ops) // n, 1)
        for start in range(0, len(ops), chunk):
            trial = ops[:start] + ops[start + chunk:]
            if run_ops(backends, cfg, trial):
                ops, n = trial, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(n * 2, len(ops))
    return ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000,
                    help="operations in all, over all episodes (default 2000)")
    ap.add_argument("--backends", default="reference,numba",
                    help="comma-separated backends; the first is the oracle (default reference,numba)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first episode (default 0)")
    ap.add_argument("--episode", type=int, default=OPS_PER_EPISODE,
                    help=f"operations per episode, each on fresh pools (default {OPS_PER_EPISODE})")
    ap.add_argument("--no-edits", action="store_true", help="no hand edits of the state (default: edits on)")
    ap.add_argument("--pages", type=int, default=None,
                    help="every episode's pool of this many pages, and batches of up to that many entries "
                         "half the time (default: 4 to 24 pages, batches of 0 to 5)")
    ap.add_argument("--mix", choices=sorted(MIXES), default="all",
                    help="the operations' mix: all kinds, or lru (caching, touches, revivals and evictions "
                         "mostly: the LRU queue wraps and is cleaned) (default all)")
    ap.add_argument("--block", type=int, default=None,
                    help="Triton's lanes per chunk, a power of two (default: the kernels' own, 32 to 2048)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    backends = args.backends.split(",")
    if "triton" in backends:
        import triton_guard
        triton_guard.setup(args.block)
    t0, done, seed = time.time(), 0, args.seed
    while done < args.ops:
        rng = random.Random(seed)
        cfg = episode_config(rng)
        if args.pages:
            cfg.update(num_pages=args.pages, max_batch=max(args.pages + 2, 8), wide=True)
        n = min(args.episode, args.ops - done)
        ops = [gen_op(rng, cfg, not args.no_edits, args.mix) for _ in range(n)]
        bad = run_ops(backends, cfg, ops)
        if bad:
            small = shrink(backends, cfg, ops[:bad[0] + 1])
            print(f"DIVERGENCE (seed {seed}): {bad[1]}")
            print(f"minimal reproducer ({len(small)} ops), config {cfg}:")
            for op in small:
                print("   ", op)
            print("   ->", run_ops(backends, cfg, small)[1])
            return 1
        done += n
        seed += 1
    print(f"ok: {done} operations on {','.join(backends)} in {time.time() - t0:.1f} s "
          f"(seeds {args.seed}..{seed - 1})")
    return 0


if __name__ == "__main__":
    if "triton" in sys.argv[-1] or any("triton" in a for a in sys.argv):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
