"""Benchmark: a decode step on a PageTable, and a step with finishes and admissions.

decode step = ``table.step(ids, ones)``: extend every request by one token
(pages for requests crossing a boundary, the slot mapping) and export the
batch's FlashInfer CSR, in one call. Also timed: the same step bound to its
input tensors once (``table.bind_step(ids, ones)``, no per-call argument
checks), as two calls (``extend`` then ``flashinfer_csr``), and each part
alone; on CUDA also the step captured in a CUDA graph and replayed (eager vs
graph); on CPU also the reference backend's step (the oracle, for scale).
The CSR copies every page id of the batch (~80 per request at these prompt
lengths), so a floor is timed too: one ``np.copyto`` of that many int32.
turnover step = 2 requests released, then one ``step`` over the batch in
which the 2 admitted requests carry their prompts (512-2048 tokens, a
prefill) and the others one token.
Each sample starts from the same table, and the baseline from the same
lists (restored untimed before it), so the requests do not grow over the run.
Baseline, measured in the same run: ``host-blocks``, per-request Python lists
of block ids with a host free list, the slot mapping and CSR built on the
host and copied into tensors, the shape of vLLM's block pool + block table.

    python benchmarks/bench_page_table.py [--batch 1 64 256 1024] [--json out.json]
"""

import argparse
import functools
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, quantiles, sample_us, write_json  # noqa: E402

import tpool  # noqa: E402
from tpool.graphs import capture, state_tensors  # noqa: E402

PAGE_SIZE = 16
PROMPTS = (512, 2048)
TURNOVER_PHASES = 16  # even: the first k requests finish; odd: the k spare ones do


class HostBlocks:
    """Host truth: a free list and per-request block lists; outputs rebuilt each step."""

    def __init__(self, num_pages, B, device):
        self.free_ids = list(range(num_pages - 1, -1, -1))
        self.blocks, self.lens = [[] for _ in range(B)], [0] * B
        self.device = device

    def extend(self, r, n):
        L = self.lens[r]
        need = -(-(L + n) // PAGE_SIZE) - -(-L // PAGE_SIZE)
        for _ in range(need):
            self.blocks[r].append(self.free_ids.pop())
        self.lens[r] = L + n
        return [self.blocks[r][(L + t) // PAGE_SIZE] * PAGE_SIZE + (L + t) % PAGE_SIZE for t in range(n)]

    def release(self, r):
        self.free_ids.extend(self.blocks[r])
        self.blocks[r], self.lens[r] = [], 0

    def decode(self, batch):
        slots = [self.extend(r, 1)[0] for r in batch]
        indptr, indices, last = [0], [], []
        for r in batch:
            indices += self.blocks[r]
            indptr.append(len(indices))
            last.append(self.lens[r] - (len(self.blocks[r]) - 1) * PAGE_SIZE)
        return tuple(torch.tensor(v, dtype=torch.int32, device=self.device) for v in (slots, indptr, indices, last))

    def snapshot(self):
        """A reset for the benchmark: puts the lists back as they are now."""
        saved = (list(self.free_ids), [list(b) for b in self.blocks], list(self.lens))

        def reset():
            self.free_ids, self.blocks, self.lens = saved[0][:], [b[:] for b in saved[1]], saved[2][:]
        return reset


def setup(B, backend, device, rng):
    R = B + 2
    MP = (PROMPTS[1] + 4096) // PAGE_SIZE
    num_pages = R * MP
    pool = tpool.PagePool(num_pages, PAGE_SIZE, device=device, backend=backend)
    table = tpool.PageTable(pool, R, MP)
    prompts = [rng.randint(*PROMPTS) for _ in range(R)]
    host = HostBlocks(num_pages, R, device)
    for r in range(B):
        table.extend(torch.tensor([r], dtype=torch.int32, device=device),
                     torch.tensor([prompts[r]], dtype=torch.int32, device=device), max_tokens=prompts[r])
        host.extend(r, prompts[r])
    return pool, table, host, prompts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", nargs="+", default=None)
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--inner", type=int, default=50)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    backends = args.backends or (["triton"] if device.type == "cuda" else ["numba"])
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    rows, table_rows = [], []
    for B in args.batch:
        rng = random.Random(B)
        impls = {}
        pool, table, host, prompts = setup(B, backends[0], device, rng)
        hb = list(range(B))
        impls["host-blocks"] = (lambda: host.decode(hb), host)
        for be in backends:
            pool, table, _, prompts = setup(B, be, device, random.Random(B))
            ids = torch.arange(B, dtype=torch.int32, device=device)
            ones = torch.ones(B, dtype=torch.int32, device=device)
            # functools.partial rather than a lambda: the harness adds a C call, not a Python frame.
            impls[f"tpool-{be} step"] = (functools.partial(table.step, ids, ones), table)
            impls[f"tpool-{be} bound step"] = (table.bind_step(ids, ones), table)
            if device.type == "cuda":  # the same step captured once, then replayed
                graph = capture(lambda table=table, ids=ids, ones=ones: table.step(ids, ones), table)
                impls[f"tpool-{be} step, graph replay"] = (graph.replay, table)

            def two_calls(table=table, ids=ids, ones=ones):
                table.extend(ids, ones)
                table.flashinfer_csr(ids)
            impls[f"tpool-{be} extend + csr"] = (two_calls, table)
            impls[f"tpool-{be} extend only"] = (functools.partial(table.extend, ids, ones), table)
            impls[f"tpool-{be} csr only"] = (functools.partial(table.flashinfer_csr, ids), table)

            # Turnover: k = min(2, B) requests finish and k are admitted. The finished ones are
            # those admitted the step before (ids alternate between two sets), and each of
            # TURNOVER_PHASES steps draws its own prompts, so a sample averages over 2 * 16
            # prompt lengths. The inputs are built once (building them is the caller's cost).
            k = min(2, B)
            spare, first = list(range(B, B + k)), list(range(k))
            t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
            phases = []
            for j in range(TURNOVER_PHASES):
                gone, admitted = (first, spare) if j % 2 == 0 else (spare, first)
                plens = [rng.randint(*PROMPTS) for _ in range(k)]
                phases.append((t32(gone), t32(admitted + list(range(k, B))), t32(plens + [1] * (B - k))))
            step_no = [0]

            def turnover(table=table, phases=phases, step_no=step_no, T=B + k * PROMPTS[1]):
                gone, batch, ntok = phases[step_no[0] % TURNOVER_PHASES]
                step_no[0] += 1
                table.release(gone)
                table.step(batch, ntok, max_tokens=T)
            turnover.restart = lambda step_no=step_no: step_no.__setitem__(0, 0)  # with the table's state
            impls[f"tpool-{be} turnover"] = (turnover, table)
        if device.type == "cpu" and "reference" not in backends:  # the oracle's step, for scale
            _, ref_table, _, _ = setup(B, "reference", device, random.Random(B))
            ids = torch.arange(B, dtype=torch.int32, device=device)
            ones = torch.ones(B, dtype=torch.int32, device=device)
            impls["tpool-reference step"] = (functools.partial(ref_table.step, ids, ones), ref_table)
        if device.type == "cpu":  # what copying the CSR's page ids once costs on this machine
            npages = sum(-(-p // PAGE_SIZE) for p in prompts[:B])
            src, dst = np.arange(npages, dtype=np.int32), np.empty(npages, dtype=np.int32)
            impls["floor: np.copyto of the CSR's page ids"] = (functools.partial(np.copyto, dst, src), None)
        base = None
        for name, (fn, tbl) in impls.items():
            reset = None
            if isinstance(tbl, HostBlocks):  # the baseline grows too: it restarts the same way
                reset = tbl.snapshot()
            elif tbl is not None:  # steps grow the table: each sample starts from the same state
                tensors = state_tensors(tbl)
                saved = [t.clone() for t in tensors]

                def reset(tensors=tensors, saved=saved, restart=getattr(fn, "restart", None)):
                    for t, s in zip(tensors, saved):
                        t.copy_(s)
                    if restart:
                        restart()
            med, p20, p80 = quantiles(sample_us(fn, inner=args.inner, samples=args.samples, sync=sync, reset=reset))
            if reset:
                reset()
            base = base or med
            rows.append(dict(batch=B, impl=name, median_us=med, p20_us=p20, p80_us=p80,
                             vs_host_blocks=base / med, device=str(device)))
            table_rows.append([B, name, f"{med:.2f}", f"{p20:.2f}", f"{p80:.2f}", f"{base / med:.2f}x"])
    print_table(f"decode step (extend 1 token + slot mapping + FlashInfer CSR), page size {PAGE_SIZE}, "
                f"prompts {PROMPTS[0]}-{PROMPTS[1]} tokens, on {device} (us per step)",
                ["B", "impl", "median", "p20", "p80", "vs host-blocks"], table_rows)
    write_json(args.json, "bench_page_table", rows)


if __name__ == "__main__":
    main()
