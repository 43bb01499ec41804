"""A page table's checks at a sync point, for tests and debugging: its invariants, and what a step's CSR memo holds.

Note: everything here reads the device (``.tolist()``, ``.cpu()``, ``bool()`` of a tensor);
:class:`tpool.PageTable`'s ``check_invariants``, ``step_grows_csr`` and ``step_keeps_csr``
call it, never a hot-path call.
"""

import torch

from tpool.errors import InvariantViolation, first_breach
from tpool.kernels import layout as L
from tpool.kernels.layout import INT32_MAX
from tpool.state import CsrMemo, clones_between_calls


def _copies(table) -> tuple:
    """``(pool state by name, table claim, block table, seq_lens, version, row_version, memos)``: copies
    taken between two calls (one ``clones_between_calls``), the memos over copies of their tensors and
    CSR buffers (those with buffers only)."""
    names, pool_tensors = zip(*table.pool.state.tensors().items())
    st = table.state
    memos = [m for m in table._shapes.memo_list() if m.csr is not None]
    own = [st.claim, st.block_table, st.seq_lens, st.version, st.row_version]
    copies = clones_between_calls([*pool_tensors, *own, *(t for m in memos for t in (m.tensor, *m.csr))])
    pool_copy, copies = dict(zip(names, copies[:len(names)])), copies[len(names):]
    (claim, bt, lens, version, row_version), copies = copies[:5], copies[5:]
    k = 1 + len(memos[0].csr) if memos else 0
    memos = [CsrMemo.over(m.batch, copies[i * k], type(m.csr)(*copies[i * k + 1:(i + 1) * k]))
             for i, m in enumerate(memos)]
    return pool_copy, claim, bt, lens, version, row_version, memos


def _naming(bt, inside, page) -> str:
    """Which table entries name ``page`` (within a request's length): ``at (request, entry) (r, k), ...``,
    the first eight (then ``... N in all``), or ``in no row``."""
    at = torch.nonzero(inside & (bt == page))
    if not at.numel():
        return "in no row"
    more = f", ... {at.shape[0]} in all" if at.shape[0] > 8 else ""
    return f"at (request, entry) {', '.join(str(tuple(e)) for e in at[:8].tolist())}{more}"


def check_table(table, exclusive: bool) -> None:
    """Raise :class:`InvariantViolation` unless ``table`` and its pool hold the invariants
    :meth:`tpool.PageTable.check_invariants` lists (the caller holds the pool's lock). Everything is
    read from one copy of the pool's and the table's state, taken between two calls."""
    table.pool.state.check_held(table.ops.st, "PagePool")
    table.state.check_held(table.ops.ts, "PageTable")
    pool_state, claim, bt, lens, version, row_version, memos = _copies(table)
    table.pool._check_state(pool_state)
    if not bool((claim == INT32_MAX).all()):  # the next call's request dedup relies on it
        raise InvariantViolation("invariant broken: the table's claim scratch is reset (INT32_MAX)")
    bt, lens = bt.cpu().long(), lens.cpu().long()
    npages = (lens + table.page_size - 1) // table.page_size
    col = torch.arange(table.max_pages, device="cpu")
    inside = col[None, :] < npages[:, None]
    if (r := first_breach((lens < 0) | (npages > table.max_pages))) is not None:
        raise InvariantViolation(f"invariant broken: seq_lens within [0, max_pages * page_size] (request {r}: "
                                 f"{int(lens[r])}, at most {table.max_pages * table.page_size})")
    if (at := first_breach(~inside & (bt != L.NULL_PAGE))) is not None:
        r, k = at
        raise InvariantViolation(f"invariant broken: entries past a request's length are -1 (request {r}, length "
                                 f"{int(lens[r])}: entry {k} is {int(bt[r, k])})")
    if (at := first_breach(inside & ((bt < 0) | (bt >= table.pool.num_pages)))) is not None:
        r, k = at
        raise InvariantViolation(f"invariant broken: entries within a request's length are page ids (request {r}: "
                                 f"entry {k} is {int(bt[r, k])}, pages {table.pool.num_pages})")
    pages = bt[inside]
    held = torch.zeros(table.pool.num_pages, dtype=torch.long, device="cpu").scatter_add_(0, pages,
                                                                                         torch.ones_like(pages))
    rc = pool_state["refcount"].cpu().long()
    if (p := first_breach(rc < held if not exclusive else rc != held)) is not None:
        raise InvariantViolation(f"invariant broken: reference counts match table entries (page {p}: refcount "
                                 f"{int(rc[p])}, table entries naming it {int(held[p])}: {_naming(bt, inside, p)})")
    # A request's partial last page is named by no other entry: both rows would append into the same
    # slots (extend reads no reference count; fork copies a partial page, truncate refuses to end in a
    # shared one, so only a hand edit makes such a pair, or a page freed under a row and popped by another).
    partial = torch.nonzero(lens % table.page_size != 0).flatten()
    last = bt[partial, npages[partial] - 1]
    if (i := first_breach(held[last] != 1)) is not None:
        p = int(last[i])
        raise InvariantViolation(f"invariant broken: a request's partial last page is named by no other table "
                                 f"entry (request {int(partial[i])}'s page {p}, {_naming(bt, inside, p)}: two "
                                 "rows would append into the same slots: was a row edited by hand, or a page it "
                                 "names freed through the pool?)")
    # A step's CSR that the next step of its batch may grow in place (numba only: its memo names
    # the table's current version, or the one the step that made it came from, since a step only
    # appends) must still be that batch's CSR at the lengths the memo noted.
    now, appended_from = version.tolist()
    for memo in memos:  # the table's and every live StepOut's and BoundStep's
        grows = memo.growable_batch(now, appended_from)
        if grows is None:
            continue
        csr, key = memo.csr, (memo.batch, memo.csr.indices.numel())
        batch, tails = grows
        behind = int(memo.held[L.MEMO_VERSION]) != now
        lanes = [(r, length, -(-length // table.page_size)) for r, (_, length) in zip(batch, tails) if r >= 0]
        want = [p for r, _, n in lanes for p in bt[r, :n].tolist()]
        if csr.indices[:len(want)].tolist() != want:
            raise InvariantViolation(f"invariant broken: the CSR of step shape {key} is its batch's CSR (the "
                                     "next step grows it in place: were its indices written to, or the table's "
                                     "state edited by hand without invalidate_csr()?)")
        # each lane's last page and length; one step behind, a length of at most the row's
        truth = [(int(bt[r, n - 1]) if n > 0 else -1, min(length, int(lens[r])) if behind else int(lens[r]))
                 for r, length, n in lanes]
        if [t for r, t in zip(batch, tails) if r >= 0] != truth:
            raise InvariantViolation(f"invariant broken: the step memo of shape {key} holds each request's "
                                     "length and last page (the next step reads them instead of the table: "
                                     "was the state edited by hand without invalidate_csr()?)")
    # The runs a step of any batch would keep from such a CSR (rows that still have the stamp
    # the memo noted) must still be those rows' pages.
    row_version = row_version.tolist()
    for memo in memos:
        for r, start, n in memo.kept_runs(row_version, table.page_size):
            if n != int(npages[r]) or memo.csr.indices[start:start + n].tolist() != bt[r, :n].tolist():
                raise InvariantViolation(
                    f"invariant broken: the CSR of step shape {(memo.batch, memo.csr.indices.numel())} holds "
                    f"request {r}'s pages where its row's stamp says they are unchanged (the next step keeps "
                    "them: were its indices written to, or the state edited by hand without invalidate_csr()?)")


def step_memo(table, req_ids, capacity, max_tokens=None):
    """The CSR memo of ``table``'s step buffers for this batch size and capacity, or None (``max_tokens``
    is checked as a step checks it, though the CSR buffers do not depend on it)."""
    b = table._ids(req_ids)
    _, _, _, cap = table._step_key(b, max_tokens, capacity)
    bufs = table._shapes.buffers.get(("step-csr", b, cap))
    return bufs[1] if bufs is not None else None


def memo_grows(memo, req_ids, version, appended_from=-1) -> bool:
    """Whether ``memo`` (or None) holds the CSR of batch ``req_ids`` at ``version`` or ``appended_from``."""
    grows = memo.growable_batch(version, appended_from) if memo is not None else None
    return grows is not None and grows[0] == req_ids.tolist()


def grows_csr(table, req_ids, capacity, max_tokens=None) -> bool:
    """:meth:`tpool.PageTable.step_grows_csr`."""
    memo = step_memo(table, req_ids, capacity, max_tokens)
    now, appended_from = table.state.version.tolist()
    return memo_grows(memo, req_ids, now, appended_from)


def keeps_csr(table, req_ids, capacity, max_tokens=None) -> int:
    """:meth:`tpool.PageTable.step_keeps_csr`."""
    memo = step_memo(table, req_ids, capacity, max_tokens)
    if memo is None or memo_grows(memo, req_ids, int(table.state.version[L.VERSION_NOW])):
        return 0
    return len(memo.kept_lanes(req_ids.tolist(), table.state.row_version.tolist()))
