"""``python -m tpool demo``: a decode loop on a PageTable, with admissions, finishes and a table.

256 requests (prompt and output lengths from a fixed seed) wait in a queue;
up to ``--batch`` run at once. Each step admits waiting requests into free
rows (a prefill ``extend``), runs one decode step for the running batch
(``extend`` by one token + the FlashInfer CSR export) and releases the
requests that finished. The scheduler knows every length on the host; the
only device data it reads is the ``ok`` of its admissions, after the timed
calls, as an engine would at the sync point after its forward pass.
"""

import argparse
import random
import statistics
import time

import torch

from tpool.page_table import PageTable
from tpool.pool import PagePool


def run(requests=256, batch=64, num_pages=4096, page_size=16, seed=0, device=None, backend="auto",
        every=25, out=print):
    rng = random.Random(seed)
    prompts = [rng.randint(128, 2048) for _ in range(requests)]
    outputs = [rng.randint(16, 384) for _ in range(requests)]
    max_pages = (max(prompts) + max(outputs)) // page_size + 1
    pool = PagePool(num_pages, page_size, device=device, backend=backend)
    table = PageTable(pool, batch, max_pages)
    dev = pool.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731

    # Warm up every kernel once (compilation), leaving no trace in the state.
    from tpool.graphs import preserved
    with preserved(table):
        table.extend(t32([0]), t32([page_size + 1]), max_tokens=page_size + 1)
        table.step(t32([0]), t32([1]))
        table.release(t32([0]))

    waiting = list(range(requests))
    row_of, generated, free_rows = {}, {}, list(range(batch - 1, -1, -1))
    failed_admissions = finished = preempted = step = 0
    decode_us, admit_us, window = [], [], []
    out(f"tpool demo: {requests} requests, up to {batch} running, {pool!r}\n", flush=True)
    out(f"{'step':>5} {'running':>7} {'waiting':>7} {'done':>5} {'pages used':>10} {'failed adm':>10} "
        f"{'preempted':>9} {'decode us':>9} {'admit us':>8}")
    while waiting or row_of:
        # Admit: up to 4 waiting requests into free rows (prefill extend), if the pages fit.
        used = sum(-(-(prompts[q] + generated[q]) // page_size) for q in row_of)
        room = num_pages - used - len(row_of)   # keep one page of growth per running request
        admit = []
        for q in waiting[:min(4, len(free_rows))]:
            need = -(-prompts[q] // page_size)
            if need + 1 > room:
                break
            admit.append(q)
            room -= need + 1
        if admit:
            rows = [free_rows[-1 - i] for i in range(len(admit))]
            sync()
            t0 = time.perf_counter()
            res = table.extend(t32(rows), t32([prompts[q] for q in admit]), max_tokens=sum(prompts[q] for q in admit))
            sync()
            admit_us.append((time.perf_counter() - t0) * 1e6)
            for q, r, ok in zip(admit, rows, res.ok.tolist()):  # a sync point: read the admissions
                if ok:
                    waiting.remove(q)
                    free_rows.remove(r)
                    row_of[q], generated[q] = r, 0
                else:
                    failed_admissions += 1
        # Decode one token for every running request.
        running = list(row_of)
        if running:
            ids = t32([row_of[q] for q in running])
            ones = torch.ones(len(running), dtype=torch.int32, device=dev)
            sync()
            t0 = time.perf_counter()
            dec = table.step(ids, ones)     # extend by one token + the batch's FlashInfer CSR
            sync()
            decode_us.append((time.perf_counter() - t0) * 1e6)
            window.append(decode_us[-1])
            stalled = []
            for q, ok in zip(running, dec.ok.tolist()):
                generated[q] += ok
                if not ok:
                    stalled.append(q)
            # Out of pages: preempt the stalled requests (release, back to the queue, recompute
            # later), as vLLM does, so the others can make progress.
            if stalled:
                table.release(t32([row_of[q] for q in stalled]))
                for q in stalled:
                    free_rows.append(row_of.pop(q))
                    waiting.insert(0, q)
                    generated[q] = 0
                preempted += len(stalled)
        # Finish: release requests that produced all their tokens.
        done = [q for q in row_of if generated[q] >= outputs[q]]
        if done:
            table.release(t32([row_of[q] for q in done]))
            for q in done:
                free_rows.append(row_of.pop(q))
                finished += 1
        if step % every == 0 or not (waiting or row_of):
            s = pool.stats()
            med = statistics.median(window) if window else 0.0
            adm = statistics.median(admit_us[-every:]) if admit_us else 0.0
            out(f"{step:>5} {len(row_of):>7} {len(waiting):>7} {finished:>5} {s['pages.used.current']:>10} "
                f"{failed_admissions:>10} {preempted:>9} {med:>9.1f} {adm:>8.1f}", flush=True)
            window = []
        step += 1
    pool.check()
    table.check_invariants()
    s = pool.stats()
    out(f"\n{step} steps; decode step median {statistics.median(decode_us):.1f} us "
        f"(p20 {statistics.quantiles(decode_us, n=10)[1]:.1f}, p80 {statistics.quantiles(decode_us, n=10)[7]:.1f}); "
        f"admission median {statistics.median(admit_us):.1f} us")
    out(f"pages allocated {s['pages.allocated']}, freed {s['pages.freed']}, peak in use {s['pages.used.peak']} "
        f"of {num_pages}; failed admissions {failed_admissions}, preemptions {preempted} (requeued, recomputed); "
        f"no errors, invariants hold")
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tpool demo", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--every", type=int, default=25, help="print a row every N steps")
    a = ap.parse_args(argv)
    run(a.requests, a.batch, a.num_pages, a.page_size, a.seed, a.device, a.backend, a.every)


if __name__ == "__main__":
    main()
