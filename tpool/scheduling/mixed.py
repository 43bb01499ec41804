"""One table step that decodes the running requests and admits new ones (prefill lanes) at once.

Note: a continuous-batching engine packs prefill lanes (the prompts it admits)
and decode lanes (running requests, one or more tokens each) into one
``table.step`` and one forward. :meth:`MixedSteps.step` is that call on the
mirror: the decode lanes take their pages from their reservations first, then
from the unreserved pages; the admissions take their prompt pages and their
reservations from what is left. It is checked on host integers before any
device work (``WouldNotFit`` otherwise), so every lane of the step succeeds
and ``ok`` need not be read. Ask :meth:`Accounting.can_admit` with the same
``rows`` and ``n`` first: it counts the decode lanes' pages beyond their
reservations before the prompts, and the lanes (at most ``max_batch`` in all).
"""

from typing import NamedTuple

import numpy as np
import torch

from tpool import _checks
from tpool.scheduling._decode import BAD_INPUT, EMPTY, FITS, NO_ROOM, PAST_MAX_LEN, decode_accounting
from tpool.scheduling.accounting import WouldNotFit, _bucket, _cdiv, _head


class MixedStep(NamedTuple):
    """What :meth:`MixedSteps.step` returns.

    rows : list of int, the rows of the admitted requests, in the order of ``prompt_lens``.
    result : StepResult, the table's.
    req_ids, num_tokens : torch.Tensor  shape ``[width]``, int32, on the table's device: the
        step's inputs (lanes: the decode rows, then the admitted rows, then padding -1 / 0). They
        are the inputs of the table's bound step the mirror keeps for this width and
        ``max_tokens`` (and ``out=``: that StepOut's), rewritten by its next step or decode of the
        same shape: clone them to keep them, and never write them (a decode-only step of the same
        lanes as the one before runs them as they are).
    """

    rows: list
    result: object
    req_ids: torch.Tensor
    num_tokens: torch.Tensor


class MixedSteps:
    """The mixed admit + decode step of :class:`tpool.scheduling.HostMirror`."""

    def step(self, rows, n=1, prompt_lens=(), max_lens=None, *, width: int | None = None,
             max_tokens: int | None = None, out=None) -> MixedStep:
        """One ``table.step``: ``n`` tokens (an int, or one per row) for each running row, and one
        prefill lane per prompt, admitting those requests.

        Parameters
        ----------
        rows : sequence of int, running rows (decode lanes, any ``n`` within their ``max_len``).
        prompt_lens, max_lens : sequences of int, as for :meth:`admit`.
        width : int, optional
            Lanes of the step (padded with ``-1``; default no padding): a fixed width keeps
            the table's call shapes, and so its buffers, few.
        max_tokens : int, optional
            Slots of the step (at least the tokens of every lane, at most the table's
            ``most_tokens``; default the total rounded up to a power of two).
        out : StepOut, optional
            Write this ``table.step_out`` instead of the table's buffers (overlap scheduling:
            two taking turns). The step then has its batch and ``max_tokens`` (``width`` and
            ``max_tokens``, when given, must be those), and ``req_ids`` / ``num_tokens`` are its
            own inputs, rewritten only by the next step into the same ``out``.

        Raises ``WouldNotFit`` (before any device work and without changing the mirror) unless
        every lane fits: the decode lanes' pages beyond their reservations plus each prompt's
        pages and reservation fit the unreserved pages. A decode row that ``n`` more tokens
        would take past its ``max_len``, like a prompt past its own, is a plain ``ValueError``
        (no release makes it fit), and so are more lanes than ``max_batch`` (admit fewer
        prompts: ``can_admit`` with these rows counts the lanes too). Every check, the table's
        included (a ``width`` or ``max_tokens`` it would refuse), is made before the mirror changes.
        Then the decode rows' reservations are topped back up (in the order of ``rows``) from
        what the admissions leave.

        Example
        -------
        >>> pool = PagePool(8, page_size=4, device="cpu", backend="reference")
        >>> m = HostMirror(PageTable(pool, 4, 4), free=8, cached=0)
        >>> (a,) = m.admit([4])                # 1 page, 1 reserved for its next token
        >>> m.can_admit([9, 9], rows=[a], n=5) # a's 5 tokens: its reserved page + 1; then 3 + 0 each
        1
        >>> s = m.step([a], 5, [9], width=3)
        >>> s.rows, s.req_ids.tolist(), s.num_tokens.tolist(), m.free, m.reserved
        ([1], [0, 1, -1], [5, 9, 0], 2, 0)
        >>> s.result.slots.tolist()            # a's 5 tokens (pages 1, 2), the prompt's 9 (pages 3-5), padding
        [4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 19, 20, -1, -1]
        >>> m.free == pool.available()
        True

        """
        r, nn, key = self._batch(rows, n)
        p, lim = self._prompts(prompt_lens, max_lens)
        ps, k = self.page_size, p.size
        b = r.size
        lanes = b + k
        if out is not None:
            self._out_lanes(out, r, nn, p)
            if width not in (None, out.batch) or max_tokens not in (None, out.max_tokens):
                raise ValueError(f"width, max_tokens: expected {out.batch} and {out.max_tokens} ({out!r}) or "
                                 f"None, got {width!r} and {max_tokens!r}")
            width, max_tokens = out.batch, out.max_tokens
        if lanes > self.max_batch:
            raise ValueError(f"step: {b} decode rows and {k} prompts make {lanes} lanes, one table call takes at "
                             f"most max_batch={self.max_batch}: admit fewer prompts (can_admit with these rows "
                             f"counts the lanes)")
        w = lanes if width is None else _checks.check_size(width, "width")  # (ints, numpy's too, as max_tokens)
        if not lanes <= w <= self.max_batch:
            raise ValueError(f"width: expected an int >= {lanes} (the step's lanes) and <= max_batch="
                             f"{self.max_batch}, got {width!r}")
        total = self._tokens(nn, b) + (sum(p.tolist()) if k else 0)
        if max_tokens is not None:  # the table's checks (the same messages), before the mirror changes
            most, max_tokens = self.table.most_tokens, _checks.check_size(max_tokens, "max_tokens")
            if max_tokens > most:
                raise ValueError(f"max_tokens: expected at most {most} (max_batch * max_pages_per_request * "
                                 f"page_size: no call appends more), got {max_tokens}")
            if total > max_tokens:
                raise ValueError(f"max_tokens: expected an int >= {total} (the step's tokens), got {max_tokens!r}")
        if k > self.rows_free:
            self._refuse_past_max_len("step", r, nn)  # work no release makes fit is refused first
            raise WouldNotFit(f"step: {k} prompts need rows, {self.rows_free} are free")
        # the prompts' pages and reservations
        admit = sum(_cdiv(min(q + self.lookahead, m), ps) for q, m in zip(p.tolist(), lim.tolist())) if k else 0
        per_row = nn.ndim > 0
        acct = self._acct
        # Decode lanes first, leaving the admissions' pages and reservations unreserved; writes only if it fits.
        code = decode_accounting(self._st, r, nn if per_row else EMPTY, 0 if per_row else int(nn), ps,
                                 self.lookahead, self.unreserved - admit, acct) if b else \
            (NO_ROOM if admit > self.unreserved else FITS)
        if code == BAD_INPUT:
            raise AssertionError(f"HostMirror.step: rows {_head(r)} outside the books (checked before: a bug)")
        if code == PAST_MAX_LEN:
            self._refuse_past_max_len("step", r, nn)
        if code == NO_ROOM:
            raise WouldNotFit(f"step: the decode lanes need {max(self._extra(r, nn), 0)} pages beyond their "
                              f"reservations and the {k} prompts {admit} with theirs, {self.unreserved} unreserved "
                              f"({self._no_room_hint('ask can_admit with these rows, and preemption, first')})")
        self._seq += 1
        self._full = None
        if b:
            taken, used, granted, _, uncertain = acct.tolist()
            if uncertain:
                self._free_inexact_at = self._seq
            self.free -= taken
            self.reserved += granted - used
        new = self._take_rows(k)
        nr = EMPTY
        if k:
            nr = np.array(new, dtype=np.int64)
            self._start_new(nr, p, lim)
        if out is None:
            max_tokens = max_tokens if max_tokens is not None else _bucket(total, self.table.most_tokens)
        # The lanes: decode rows, then admitted rows, then padding, written into the inputs of the bound
        # step of this width, max_tokens and ``out`` (``_lanes_run``) unless they hold them already (a
        # decode-only step of the batch before: the lanes are named by the rows and their tokens).
        dkey = None if k else ((key, nn.tobytes()) if per_row else (key, int(nn)))
        run, ids_t, ntok_t = self._lanes_run(dkey, w, max_tokens, out, r, nn if per_row else EMPTY,
                                             0 if per_row else int(nn), p, nr)
        return MixedStep(new, run(), ids_t, ntok_t)
