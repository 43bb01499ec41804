"""The triton backend: one launch of a single-program Triton kernel per call.

Note: every kernel runs as one program that loops over fixed-size chunks
(see ``tpool.kernels._triton_util``), so results never depend on the order
in which atomics land. On a CPU it runs only under ``TRITON_INTERPRET=1``
(for tests). ``step`` is one launch: the extend, a barrier, the CSR export.
Importing this module imports triton (``tpool.kernels._triton_shim.load``),
so the kernels are real Triton kernels before the first launch (and before
any graph capture).
"""

import torch

from tpool.backends.contract import BoundByTensors, PoolByFunctions, locked
from tpool.backends.reference_table import ends_in_shared_page
from tpool.kernels import _triton_shim
from tpool.kernels import alloc, block_table_rows, evict, extend, flashinfer_csr, fork, free, incref, release, step
from tpool.kernels import revive, touch
from tpool.state import held_view

_triton_shim.load()  # raises ImportError naming the extra when triton is not installed


class Pool(PoolByFunctions):
    """The pool's operations on Triton (the contract: ``tpool.backends.contract.PoolOps``)."""

    name = "triton"

    def __init__(self, st):
        super().__init__(st, alloc.alloc_triton, free.free_triton, incref.incref_triton, touch.touch_triton,
                         evict.evict_triton)


class Table(BoundByTensors):
    """A page table's operations on Triton (the contract: ``tpool.backends.contract.TableOps``)."""

    name = "triton"

    def __init__(self, st, ts):
        self.st, self.ts = st, ts

    @locked
    def extend(self, req_ids, num_tokens, slots, ok, meta=None):
        extend.extend_triton(req_ids, num_tokens, slots, ok, self.st, self.ts, meta)

    @locked
    def release(self, req_ids, cache):
        release.release_triton(req_ids, cache, self.st, self.ts)

    @locked
    def truncate(self, req_ids, new_lens, drop=False):
        # A lane that would end inside a shared page gets length -1 (a bad_length), decided on
        # the reference counts as the call starts (the kernel's frees change them): a few
        # gathers, no host read. A drop becomes a length in the same gathers.
        st, ts = self.st, self.ts
        if req_ids.numel():
            rr = req_ids.long().clamp(0, ts.block_table.shape[0] - 1)  # bad ids, padding: skipped by the kernel
            length = ts.seq_lens[rr].long()
            n = length - new_lens.long() if drop else new_lens.long()
            shared = ends_in_shared_page(st, ts, rr, n, length)
            # -1 (a bad_length) for a length outside [0, length] too: no int32 wrap can make it valid
            new_lens = torch.where(shared | (n < 0) | (n > length), -1, n).to(torch.int32)
        release.truncate_triton(req_ids, new_lens, st, ts)

    @locked
    def fork(self, src_ids, dst_ids, lens, ok, cow_src, cow_dst):
        fork.fork_triton(src_ids, dst_ids, lens, ok, cow_src, cow_dst, self.st, self.ts)

    @locked
    def flashinfer_csr(self, req_ids, indptr, indices, last_page_len):
        """Export into any buffers: ``indices`` is re-padded whole."""
        written = torch.full((1,), indices.numel(), dtype=torch.int64, device=indices.device)
        flashinfer_csr.flashinfer_csr_triton(req_ids, indptr, indices, last_page_len, written, self.st, self.ts)

    def _csr_call(self, csr, memo):  # re-pads only as far as the last export into csr wrote (the memo)
        indptr, indices, last = map(held_view, csr)
        st, ts, written = self.st, self.ts, memo.held
        return lambda req_ids: flashinfer_csr.flashinfer_csr_triton(req_ids, indptr, indices, last, written, st, ts)

    def step_into(self, res, memo):  # one launch: extend, barrier, CSR
        indptr, indices, last, slots, ok, *meta = map(held_view, (*res.csr, res.slots, res.ok, *res.metadata))
        st, ts, written = self.st, self.ts, memo.held

        def run(req_ids, num_tokens, b, release=None, cache=False):
            with st.lock:  # a release first is its own launch
                if release is not None:
                    self.release(release, cache)
                step.step_triton(req_ids, num_tokens, slots, ok, meta, indptr, indices, last, written, st, ts)
        return run

    @locked
    def revive(self, row, pages, memos=(), gens=None):  # (no run is kept: the memos need nothing)
        revive.revive_triton(row, pages, self.st, self.ts, gens)

    @locked
    def block_table_rows(self, req_ids, out):
        block_table_rows.block_table_rows_triton(req_ids, out, self.st, self.ts)
