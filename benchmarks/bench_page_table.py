"""Benchmark: a decode step on a PageTable, and a step with finishes and admissions.

decode step = ``table.step(ids, ones)``: extend every request by one token
(pages for requests crossing a boundary, the slot mapping) and export the
batch's FlashInfer CSR, in one call. Also timed: the same step bound to its
input tensors once (``table.bind_step(ids, ones)``, no per-call argument
checks; on CPU also ``table.bind_step(batch=B)``, inputs the table makes, no
check at all), as two calls (``extend`` then ``flashinfer_csr``), and each part
alone; on CUDA also the step captured in a CUDA graph and replayed (eager vs
graph); on CPU also the reference backend's step (the oracle, for scale).
The CSR copies every page id of the batch (~80 per request at these prompt
lengths), so a floor is timed too: one ``np.copyto`` of that many int32.
turnover step = 2 requests released, then one ``step`` over the batch in
which the 2 admitted requests carry their prompts (512-2048 tokens, a
prefill) and the others one token; "turnover, one call" is the same as
``step(..., release=gone)``, one façade call instead of two; "turnover, bound"
(CPU) is ``table.bind_step(batch=B, release=2)`` called after writing the lanes
that changed into its arrays (the finished ids, the admitted ids and their
prompt lengths), as a scheduler with a persistent batch would: no torch call.
Each sample starts from the same table, and the baseline from the same
lists (restored untimed before it, then one untimed call), so the requests do
not grow over the run and a warm sample times the steady state; within a sample
they grow one token a call, and a calibrated sample makes at most ``WARM_INNER``
calls, so tpool's rows and the baselines' time requests of about the same length.
Baselines (``_baselines.py``), measured in the same run, with the same requests
and pages: ``numpy-blocks``, the host truth in numpy arrays (a free stack, a block
table, lengths) with every step vectorised: the pages popped in one slice, the
slot mapping computed as vLLM V1's model runner does from its numpy block table,
the whole CSR built on the host (its page ids by a boolean mask over the batch's
rows), no Python loop over requests (the best case of a host block table); and
``vllm-blocks``, the KV-cache part of vLLM V1's host work per step as its
scheduler and worker do it: a Python loop over the requests taking pages from
vLLM's free queue (a linked list of block objects with reference counts,
``KVCacheManager.allocate_slots`` -> ``BlockPool.get_new_blocks``), the new ids
appended to the worker's numpy block table (``BlockTable.append_row``), the
vectorised slot mapping, the CSR's ``indptr`` and last page lengths, and the
batch's block-table rows handed over (vLLM gathers the CSR's page ids from them
on the GPU: not timed here, though tpool's step writes them; prefix caching off;
the rest of vLLM's scheduler not counted). tpool's step also writes positions,
``qo_indptr`` and ``kv_lens``. On CUDA both baselines hand their outputs to the
GPU as vLLM does: into pinned buffers kept from step to step, then a
non-blocking copy each. Their turnover rows release and admit the same
requests. ``vllm-blocks`` is left out of a pool-size sweep (a page is a Python
object). Each row has a ratio against each baseline of its kind (decode or
turnover), ``vs numpy-blocks`` and ``vs vllm-blocks``: the baseline's median over
the row's, above 1 the row is faster.

``--cold``: in a serving loop the forward pass evicts the CPU caches between two
scheduler steps. This mode also times the decode and turnover rows (and their
baselines) one call at a time with 64 MiB written into a numpy buffer before
each call (outside the timed region), and shows warm and cold side by side.
Each cold sample: one untimed step, write 64 MiB, time one step (so the timed
step grows the CSR of the step before, as in a decode loop); the clock is read
right before and after the call, with no loop between (a loop's code is cold too). The table is
restored once before the cold samples, not before each: restoring a large
pool's state (~1 GB at 16M pages) right before a timed step slows that step
even after the 64 MiB, which a serving loop never does (``_common.sample_cold_us``).

    python benchmarks/bench_page_table.py                       # the table, about 10 s
    python benchmarks/bench_page_table.py --batch 256 --cold    # warm vs cold at B=256
    python benchmarks/bench_page_table.py --batch 256 --pool-sizes 65536 1048576 16777216 --plot step.png
"""

import argparse
import gc
import functools
import itertools
import operator
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _baselines import NumpyBlocks, VllmBlocks  # noqa: E402
from _common import (Distinct, COLD_BYTES, CacheFlusher, HelpFormatter, calibrate, check_backends,  # noqa: E402
                     default_device, device_arg, gc_quiet, int_at_most, out_path, parse_args_for_plot, plot_lines,
                     positive_int, print_table, progress, quantiles, ratio_text, sample_cold_us, sample_us, size_text,
                     sync_of, write_json)

import tpool  # noqa: E402

EPILOG = ("Progress goes to stderr, one line per row. Rows: numpy-blocks (a host block table in numpy, every step "
          "vectorised, the CSR built on the host), vllm-blocks (vLLM V1's per-step host "
          "KV-cache work: its free queue of block objects, a Python loop per request, its numpy block table, the "
          "slot mapping, indptr and the rows handed over; the CSR's page ids, which vLLM gathers on the GPU, not "
          "counted; not in a --pool-sizes sweep), "
          "tpool's step, bound step, extend + csr, extend only, csr only, turnover (release then step, in one "
          "call, and bound), the reference step and an np.copyto floor (CPU). Ratios 'vs numpy-blocks' and 'vs "
          "vllm-blocks': that baseline's median over the row's, of the same kind (decode or turnover; above 1: "
          "the row is faster).")
from tpool.graphs import capture, state_tensors  # noqa: E402

PAGE_SIZE = 16
PROMPTS = (512, 2048)
TURNOVER_PHASES = 16  # even: the first k requests finish; odd: the k spare ones do
MAX_INNER = 1000      # calls per sample at most: each decode call adds a token to every request
# Calls per warm sample at most when calibrated (~2 ms a sample would take 1,000 tpool calls, and its
# requests would end ~1,000 tokens longer than a baseline's of ~17 calls): 64 keep both within tokens.
WARM_INNER = 64
HEADROOM = 4096       # tokens a request may grow by during a sample, beyond its longest prompt


def release_then_step(blocks, gone, batch, ntok):
    """A baseline's turnover step (``VllmBlocks`` or ``NumpyBlocks``): release the finished requests,
    then step the batch; returns the step's outputs."""
    for r in gone:
        blocks.release(r)
    return blocks.step(batch, ntok)


def sizes(B, num_pages=None):
    """Rows, pages per row and pool pages of a configuration of ``B`` lanes."""
    R, MP = B + 2, (PROMPTS[1] + HEADROOM) // PAGE_SIZE
    return R, MP, num_pages or R * MP


def setup(B, backend, device, rng, num_pages=None):
    R, MP, num_pages = sizes(B, num_pages)
    pool = tpool.PagePool(num_pages, PAGE_SIZE, device=device, backend=backend)
    table = tpool.PageTable(pool, R, MP)
    prompts = draw_prompts(rng, R)
    for r in range(B):
        table.extend(torch.tensor([r], dtype=torch.int32, device=device),
                     torch.tensor([prompts[r]], dtype=torch.int32, device=device), max_tokens=prompts[r])
    return pool, table, prompts


def draw_prompts(rng, R):
    """One prompt length per row of ``R``, drawn from ``rng`` (rows 0..B-1 hold theirs from the start)."""
    return [rng.randint(*PROMPTS) for _ in range(R)]


def baseline(cls, B, device, num_pages=None):
    """A baseline (``NumpyBlocks`` or ``VllmBlocks``) holding :func:`setup`'s prompts in rows 0..B-1, admitted in
    one step (the pages in row order, as setup() gives the table's)."""
    R, MP, pages = sizes(B, num_pages)
    blocks = cls(pages, R, MP, device, page_size=PAGE_SIZE)
    prompts = draw_prompts(random.Random(B), R)[:B]  # setup()'s, as workloads() draws them
    if cls is NumpyBlocks:
        blocks.step(np.arange(B), np.array(prompts))
    else:
        blocks.step(list(range(B)), prompts)
    return blocks


def pages_needed(B):
    """A safe bound on the pages one configuration uses (prompts, growth in a sample, admissions)."""
    return (B + 2) * (-(-(PROMPTS[1] + MAX_INNER) // PAGE_SIZE) + 1)


def turnover_phases(B, rng):
    """TURNOVER_PHASES of (finished ids, batch ids, tokens per lane) as lists.

    k = min(2, B) requests finish and k are admitted. The finished ones are those
    admitted the step before (ids alternate between two sets), and each phase
    draws its own prompts, so a sample averages over 2 * 16 prompt lengths.
    """
    k = min(2, B)
    spare, first = list(range(B, B + k)), list(range(k))
    phases = []
    for j in range(TURNOVER_PHASES):
        gone, admitted = (first, spare) if j % 2 == 0 else (spare, first)
        plens = [rng.randint(*PROMPTS) for _ in range(k)]
        phases.append((gone, admitted + list(range(k, B)), plens + [1] * (B - k)))
    return phases


class Turnover:
    """One turnover step per call, cycling through the phases; ``restart`` goes back to phase 0."""

    def __init__(self, step_fn, phases):
        self.step_fn, self.phases, self.n = step_fn, phases, 0

    def __call__(self):
        self.step_fn(*self.phases[self.n % TURNOVER_PHASES])
        self.n += 1

    def restart(self):
        self.n = 0


# The rows ``workloads`` can make: each backend's (``tpool-<backend> <row>``; some only on a CPU or
# only on CUDA, some only with extras) and the others. Known before anything compiles, so a
# script taking row names (``ab_compare.py``) refuses a misspelt one at once.
BACKEND_ROWS = ("step", "bound step", "bound step, two StepOuts taking turns", "bound step, table-made inputs",
                "step, graph replay", "extend + csr", "extend only", "csr only", "turnover", "turnover, one call",
                "turnover, bound")
BASELINES = {"numpy-blocks": "numpy_blocks", "vllm-blocks": "vllm_blocks"}  # the ratio columns (row -> JSON key)
OTHER_ROWS = ("numpy-blocks", "numpy-blocks turnover", "vllm-blocks", "vllm-blocks turnover", "tpool-reference step",
              "floor: np.copyto of the CSR's page ids")


def row_names(backends) -> list:
    """Every row name ``workloads(..., backends)`` may make, in its order."""
    return OTHER_ROWS[:4] + tuple(f"tpool-{be} {row}" for be in backends for row in BACKEND_ROWS) + OTHER_ROWS[4:]


def workloads(B, backends, device, *, num_pages=None, extras=True):
    """name -> (fn, owner, kind): owner is restored before each sample; kind is decode, turnover or other.
    Its names are among :func:`row_names`."""
    impls = {}
    prompts = draw_prompts(random.Random(B), sizes(B)[0])
    lanes, ones = np.arange(B), np.ones(B, dtype=np.int64)
    nb = baseline(NumpyBlocks, B, device, num_pages)
    impls["numpy-blocks"] = (functools.partial(nb.step, lanes, ones, persistent=True), nb, "decode")
    nb2 = baseline(NumpyBlocks, B, device, num_pages)
    np_phases = [(gone, np.array(batch), np.array(ntok)) for gone, batch, ntok in
                 turnover_phases(B, random.Random(B + 1))]
    impls["numpy-blocks turnover"] = (Turnover(functools.partial(release_then_step, nb2), np_phases), nb2,
                                      "turnover")
    if num_pages is None:  # (a page is a Python object here: not in a pool-size sweep, up to 16M pages)
        vb = baseline(VllmBlocks, B, device, num_pages)
        impls["vllm-blocks"] = (functools.partial(vb.step, list(range(B)), [1] * B), vb, "decode")
        vb2 = baseline(VllmBlocks, B, device, num_pages)
        impls["vllm-blocks turnover"] = (Turnover(functools.partial(release_then_step, vb2),
                                                  turnover_phases(B, random.Random(B + 1))), vb2, "turnover")
    for be in backends:
        _, table, _ = setup(B, be, device, random.Random(B), num_pages)
        ids = torch.arange(B, dtype=torch.int32, device=device)
        ones = torch.ones(B, dtype=torch.int32, device=device)
        # functools.partial rather than a lambda: the harness adds a C call, not a Python frame.
        impls[f"tpool-{be} step"] = (functools.partial(table.step, ids, ones), table, "decode")
        impls[f"tpool-{be} bound step"] = (table.bind_step(ids, ones), table, "decode")
        # Overlap scheduling: steps take turns writing two StepOuts (the forward of step N reads one
        # while step N+1 writes the other). C calls only: next() on a map that calls each bound step.
        turns = itertools.cycle([table.bind_step(ids, ones, out=table.step_out(B)) for _ in range(2)])
        impls[f"tpool-{be} bound step, two StepOuts taking turns"] = (
            functools.partial(next, map(operator.methodcaller("__call__"), turns)), table, "decode")
        if device.type == "cpu":  # inputs the table makes: memory that cannot move, so no check per call
            fixed = table.bind_step(batch=B)
            fixed.req_ids[:] = ids.numpy()  # numpy arrays on a CPU
            fixed.num_tokens[:] = 1
            impls[f"tpool-{be} bound step, table-made inputs"] = (fixed, table, "decode")
        if device.type == "cuda":  # the same step captured once, then replayed
            graph = capture(lambda table=table, ids=ids, ones=ones: table.step(ids, ones), table)
            impls[f"tpool-{be} step, graph replay"] = (graph.replay, table, "decode")
        if extras:
            def two_calls(table=table, ids=ids, ones=ones):
                table.extend(ids, ones)
                table.flashinfer_csr(ids)
            impls[f"tpool-{be} extend + csr"] = (two_calls, table, "decode")
            impls[f"tpool-{be} extend only"] = (functools.partial(table.extend, ids, ones), table, "other")
            impls[f"tpool-{be} csr only"] = (functools.partial(table.flashinfer_csr, ids), table, "other")
        # The turnover inputs are built once as tensors (building them is the caller's cost).
        t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        phases = [tuple(t32(v) for v in ph) for ph in turnover_phases(B, random.Random(B + 1))]

        def turn(gone, batch, ntok, table=table, T=B + min(2, B) * PROMPTS[1]):
            table.release(gone)
            table.step(batch, ntok, max_tokens=T)
        impls[f"tpool-{be} turnover"] = (Turnover(turn, phases), table, "turnover")

        def turn_one_call(gone, batch, ntok, table=table, T=B + min(2, B) * PROMPTS[1]):
            table.step(batch, ntok, max_tokens=T, release=gone)
        impls[f"tpool-{be} turnover, one call"] = (Turnover(turn_one_call, phases), table, "turnover")
        if device.type == "cpu":  # bound, inputs and release ids the table makes: a scheduler writes the lanes
            k = min(2, B)          # that changed (the finished ids, the admitted ids and their prompts)
            run = table.bind_step(batch=B, max_tokens=B + k * PROMPTS[1], release=k)
            run.req_ids[:], run.num_tokens[:] = np.arange(B, dtype=np.int32), 1
            bound_phases = [tuple(np.array(v[:k], dtype=np.int32) for v in ph)
                            for ph in turnover_phases(B, random.Random(B + 1))]

            def turn_bound(gone, admitted, plens, run=run, k=k):
                run.release[:k], run.req_ids[:k], run.num_tokens[:k] = gone, admitted, plens
                run()
            impls[f"tpool-{be} turnover, bound"] = (Turnover(turn_bound, bound_phases), table, "turnover")
    if extras and device.type == "cpu" and "reference" not in backends:  # the oracle's step, for scale
        _, ref_table, _ = setup(B, "reference", device, random.Random(B), num_pages)
        ids = torch.arange(B, dtype=torch.int32, device=device)
        ones = torch.ones(B, dtype=torch.int32, device=device)
        impls["tpool-reference step"] = (functools.partial(ref_table.step, ids, ones), ref_table, "decode")
    if extras and device.type == "cpu":  # what copying the CSR's page ids once costs on this machine
        npages = sum(-(-p // PAGE_SIZE) for p in prompts[:B])
        src, dst = np.arange(npages, dtype=np.int32), np.empty(npages, dtype=np.int32)
        impls["floor: np.copyto of the CSR's page ids"] = (functools.partial(np.copyto, dst, src), None, "other")
    assert set(impls) <= set(row_names(backends)), set(impls) - set(row_names(backends))
    return impls


def make_reset(fn, owner):
    """An untimed reset putting ``owner`` (a table or a baseline) back as it is now, or None.

    For a table, each reset first checks the samples since the last one: ``pool.check()`` (no error
    counted) and no lane refused (``requests.failed`` unchanged); it raises otherwise.
    """
    restart = getattr(fn, "restart", None)
    if isinstance(owner, (VllmBlocks, NumpyBlocks)):  # the baselines grow too: they restart the same way
        restore = owner.snapshot()
    elif owner is not None:  # steps grow the table: each sample starts from the same state
        tensors = state_tensors(owner)
        saved = [t.clone() for t in tensors]
        pool = owner.pool
        failed = pool.stats()["requests.failed"]

        def restore():
            # The samples' sanity check, before the restore erases their counters: no error counted and no
            # lane refused (a refused lane returns at once: the row would time less work than its baseline).
            pool.check()
            now = pool.stats()["requests.failed"]
            if now != failed:
                raise AssertionError(f"{now - failed} lanes refused during the samples: the pool ran out of pages")
            for t, s in zip(tensors, saved):
                t.copy_(s)
    else:
        return None

    def reset():
        restore()
        if restart:
            restart()
    return reset


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EPILOG,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--batch", type=positive_int, nargs="+", action=Distinct, default=[1, 64, 256, 1024], metavar="B",
                    help="requests in the batch (one group of rows per B)")
    ap.add_argument("--device", default=default_device(), type=device_arg, help="torch device of the pool and table")
    ap.add_argument("--backends", nargs="+", action=Distinct, default=None,
                    help="tpool backends to time (default: numba on CPU, triton on CUDA); on a CPU the reference "
                         "backend's plain decode step gets a row too, sampled as the others, for scale (not in a "
                         "pool-size sweep), unless reference is listed (then every row of it)")
    ap.add_argument("--samples", type=positive_int, default=30, help="samples per row (median, p20, p80 over them)")
    ap.add_argument("--inner", type=int_at_most(MAX_INNER, "each call adds a token to every request"), default=None,
                    help=f"calls per warm sample, at most {MAX_INNER}: each call adds a token to every request "
                         f"(default: calibrated to about 2 ms a sample, at most {WARM_INNER} calls)")
    ap.add_argument("--cold", action="store_true",
                    help="also time decode and turnover rows one call at a time with --cold-bytes written "
                         "between calls (cold CPU caches; on CUDA the GPU's own L2 stays warm)")
    ap.add_argument("--cold-samples", type=int_at_most(MAX_INNER // 2, "two steps per sample, from one reset"),
                    default=100, help=f"calls timed per row in --cold mode, at most {MAX_INNER // 2} (each sample "
                                      "steps twice and the samples run from one reset)")
    ap.add_argument("--cold-bytes", type=positive_int, default=COLD_BYTES, help="bytes written between two cold calls")
    ap.add_argument("--pool-sizes", type=positive_int, nargs="+", action=Distinct, default=None, metavar="P",
                    help="sweep the pool size (pages) instead of sizing the pool to the batch, e.g. "
                         "65536 1048576 16777216: only the decode and turnover rows, to show they stay flat "
                         "(default: (B + 2) x 384 pages, sized to the batch)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--plot", type=out_path, default="", metavar="PATH",
                    help="also write a PNG: us against B, or against the pool size with --pool-sizes")
    return ap


SWEEP_ROUNDS = 5  # a pool-size sweep takes turns between the sizes this many times per row (cold: in blocks)


def time_row(runs, args, sync, flush, kind):
    """Warm and cold quantiles of one row for each configuration in ``runs`` (key -> (fn, reset)).

    One configuration: its samples in one go. Several (a pool-size sweep): the
    configurations take turns, a warm sample each per turn, and cold samples in
    ``SWEEP_ROUNDS`` blocks (a reset right before a cold sample would slow it), so
    the machine's noise falls on every size alike instead of on whichever ran during
    a busy minute. Returns key -> (warm, cold or None).
    """
    warm = {k: [] for k in runs}
    cold = {k: [] for k in runs} if flush and kind != "other" else None
    inner = {k: args.inner or calibrate(fn, sync=sync, reset=reset, max_inner=WARM_INNER)
             for k, (fn, reset) in runs.items()}
    turns = args.samples if len(runs) > 1 else 1
    for _ in range(turns):
        for k, (fn, reset) in runs.items():
            warm[k] += sample_us(fn, inner=inner[k], samples=args.samples // turns, sync=sync, reset=reset,
                                 settle=True)
    if cold is not None:
        blocks = SWEEP_ROUNDS if len(runs) > 1 else 1
        for b in range(blocks):
            for k, (fn, reset) in runs.items():
                n = args.cold_samples // blocks + (b < args.cold_samples % blocks)
                cold[k] += sample_cold_us(fn, samples=n, flush=flush, sync=sync, reset=reset, settle=True)
    return {k: (quantiles(warm[k]), quantiles(cold[k]) if cold else None) for k in runs}


def main(argv=None):
    ap = parser()
    args = parse_args_for_plot(ap, argv)
    device = torch.device(args.device)
    backends = args.backends or (["triton"] if device.type == "cuda" else ["numba"])
    check_backends(ap, "--backends", backends, device)
    if args.pool_sizes and max(args.pool_sizes) < pages_needed(min(args.batch)):  # no row could run: not one table
        ap.error(f"argument --pool-sizes: expected at least {pages_needed(min(args.batch))} pages, what the smallest "
                 f"--batch ({min(args.batch)}) needs, got {' '.join(map(str, args.pool_sizes))}")
    sync = sync_of(device)
    flush = CacheFlusher(args.cold_bytes) if args.cold else None
    rows, table_rows = [], []
    for B in args.batch:
        configs = {}  # pool size (None: sized to the batch) -> workloads, all alive at once in a sweep
        for P in args.pool_sizes or [None]:
            where = f"B={B}" + (f", pool {P:,} pages" if P else "")
            if P and P < pages_needed(B):
                progress(f"{where}: skipped, needs {pages_needed(B):,} pages")
                continue
            progress(f"{where}: setting up")
            configs[P] = workloads(B, backends, device, num_pages=P, extras=P is None)
        gc_quiet()  # the baselines' P-element Python lists must not slow every GC pass
        if not configs:
            continue
        if args.pool_sizes:
            progress("vllm-blocks left out of a pool-size sweep: a page would be a Python object")
        base = {P: {} for P in configs}  # P -> (baseline, kind) -> (warm, cold) medians
        for name in next(iter(configs.values())):
            kind = next(iter(configs.values()))[name][2]
            progress(f"B={B}: {name}" + (", pool sizes taking turns" if len(configs) > 1 else ""))
            runs = {P: (impls[name][0], make_reset(impls[name][0], impls[name][1])) for P, impls in configs.items()}
            timed = time_row(runs, args, sync, flush, kind)
            for P, (warm, cold) in timed.items():
                for b in BASELINES:  # the baselines of its kind: rows after them get a ratio
                    if name.startswith(b):
                        base[P][b, kind] = (warm[0], cold[0] if cold else None)
                row = dict(batch=B, num_pages=P or impls_pages(configs[P]), impl=name, kind=kind,
                           median_us=warm[0], p20_us=warm[1], p80_us=warm[2], device=str(device))
                if cold:
                    row.update(cold_median_us=cold[0], cold_p20_us=cold[1], cold_p80_us=cold[2])
                for b, key in BASELINES.items():
                    w, c = base[P].get((b, kind), (None, None))
                    if w:
                        row[f"vs_{key}"] = w / warm[0]
                        if c and cold:
                            row[f"cold_vs_{key}"] = c / cold[0]
                rows.append(row)
                ratio = lambda k: ratio_text(row.get(k))  # noqa: E731
                cells = [B] + ([f"{P:,}"] if args.pool_sizes else []) + [
                    name, f"{warm[0]:.2f}", f"{warm[1]:.2f}", f"{warm[2]:.2f}",
                    *(ratio(f"vs_{key}") for key in BASELINES.values())]
                if args.cold:
                    cells += [f"{cold[0]:.2f}", f"{cold[1]:.2f}", f"{cold[2]:.2f}",
                              *(ratio(f"cold_vs_{key}") for key in BASELINES.values())] \
                        if cold else [""] * (3 + len(BASELINES))
                table_rows.append(cells)
        del configs
        gc.unfreeze()
    header = ["B"] + (["pool pages"] if args.pool_sizes else []) + ["impl", "median", "p20", "p80"] + [
        f"vs {b}" for b in BASELINES]
    if args.cold:
        header += ["cold median", "cold p20", "cold p80"] + [f"cold vs {b}" for b in BASELINES]
    print_table(f"decode step (extend 1 token + slot mapping + FlashInfer CSR), page size {PAGE_SIZE}, "
                f"prompts {PROMPTS[0]}-{PROMPTS[1]} tokens, on {device} (us per step"
                + (f"; cold: {size_text(flush.buf.nbytes)} written before each call" if args.cold else "") + ")",
                header, table_rows,
                note="Ratios: the baseline's median over the row's, of the same kind (decode or turnover; above 1: "
                     "faster); extend-only, csr-only and floor rows have none, nor vllm-blocks in a pool-size sweep "
                     "(left out). numpy-blocks: the host truth in numpy, "
                     "every step vectorised (the pages popped in one slice, the slot mapping as vLLM V1's model "
                     "runner computes it, the CSR's page ids by a boolean mask), no Python loop per request. "
                     "vllm-blocks: vLLM V1's host KV-cache work per step (allocate_slots per request on its free "
                     "queue of block objects, BlockTable.append_row, the same vectorised slot mapping, indptr and "
                     "the last page lengths; the CSR's page ids, which vLLM gathers on the GPU, not counted; prefix "
                     "caching off).")
    write_json(args.json, "bench_page_table", rows)
    if args.plot:
        sweep = args.pool_sizes is not None
        series = {}
        for r in rows:
            if r["kind"] == "other" or r["impl"].startswith("tpool-reference"):
                continue
            x = r["num_pages"] if sweep else r["batch"]
            label = r["impl"] + (f", B={r['batch']}" if sweep and len(args.batch) > 1 else "")
            series.setdefault(label + (", warm" if args.cold else ""), []).append(
                (x, r["median_us"], r["p20_us"], r["p80_us"]))
            if "cold_median_us" in r:
                series.setdefault(label + ", cold", []).append(
                    (x, r["cold_median_us"], r["cold_p20_us"], r["cold_p80_us"]))
        plot_lines(args.plot, series, xlabel="pool size (pages)" if sweep else "batch size B (requests)",
                   title="decode and turnover step on " + str(device) + (" against pool size" if sweep else ""))


def impls_pages(impls):
    """The pool size of a configuration sized to its batch (for the JSON rows)."""
    for fn, owner, kind in impls.values():
        if isinstance(owner, tpool.PageTable):
            return owner.pool.num_pages
    return None


if __name__ == "__main__":
    main()
