"""Benchmark: a decode step on a PageTable, and a step with finishes and admissions.

decode step = ``extend(ids, ones)`` (pages for requests crossing a boundary,
slot mapping for the new tokens) + ``flashinfer_csr(ids)`` for the batch; the
two parts are also timed alone ("extend only", "csr only": the CSR copies
every page id of the batch, ~80 per request at these prompt lengths).
turnover step = the decode step, plus 2 requests released and 2 admitted
with prompts of 512-2048 tokens (prefill extend).
Baseline, measured in the same run: ``host-blocks``, per-request Python lists
of block ids with a host free list, the slot mapping and CSR built on the
host and copied into tensors, the shape of vLLM's block pool + block table.

    python benchmarks/bench_page_table.py [--batch 1 64 256 1024] [--json out.json]
"""

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, quantiles, sample_us, write_json  # noqa: E402

import tpool  # noqa: E402

PAGE_SIZE = 16
PROMPTS = (512, 2048)


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
        return (torch.tensor(slots, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int32),
                torch.tensor(indices, dtype=torch.int32), torch.tensor(last, dtype=torch.int32))


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
        impls["host-blocks"] = (lambda: host.decode(hb), None)
        for be in backends:
            pool, table, _, prompts = setup(B, be, device, random.Random(B))
            ids = torch.arange(B, dtype=torch.int32, device=device)
            ones = torch.ones(B, dtype=torch.int32, device=device)

            def decode(table=table, ids=ids, ones=ones):
                table.extend(ids, ones)
                table.flashinfer_csr(ids)
            impls[f"tpool-{be}"] = (decode, table)
            impls[f"tpool-{be} extend only"] = (lambda table=table, ids=ids, ones=ones: table.extend(ids, ones), table)
            impls[f"tpool-{be} csr only"] = (lambda table=table, ids=ids: table.flashinfer_csr(ids), None)

            # Turnover: k = min(2, B) requests finish and k are admitted (prefill), then decode.
            # Inputs for the two alternating phases are built once: building them is the caller's cost.
            k = min(2, B)
            spare, first = list(range(B, B + k)), list(range(k))
            t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
            phases = [(t32(first), t32(spare), t32(spare + list(range(k, B)))),
                      (t32(spare), t32(first), t32(first + list(range(k, B))))]
            plens = t32([rng.randint(*PROMPTS) for _ in range(k)])
            step_no = [0]

            def turnover(table=table, phases=phases, plens=plens, ones=ones, step_no=step_no):
                gone, admitted, batch = phases[step_no[0] % 2]
                step_no[0] += 1
                table.release(gone)
                table.extend(admitted, plens, max_tokens=2 * PROMPTS[1])
                table.extend(batch, ones)
                table.flashinfer_csr(batch)
            impls[f"tpool-{be} turnover"] = (turnover, table)
        base = None
        for name, (fn, tbl) in impls.items():
            if tbl is not None:
                from tpool.graphs import preserved
                ctx = preserved(tbl)    # steps grow the table; restore it after timing
            else:
                import contextlib
                ctx = contextlib.nullcontext()
            with ctx:
                med, p20, p80 = quantiles(sample_us(fn, inner=args.inner, samples=args.samples, sync=sync))
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
