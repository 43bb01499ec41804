"""Layout shared by every backend: page states, counter slots, sentinels, descriptor slots.

Note: a pool's whole state is a handful of tensors allocated once (see
``tpool.state.PoolState``; a table's: ``tpool.state.TableState``).
``counters`` is an int64 vector whose slots are named below; free and cached
counts live there too, so one kernel launch reads and updates them without a
host round trip. The numba kernels receive addresses packed in int64
descriptors; their slots are named at the end of this module.
"""

INT32_MAX = 2**31 - 1  # the claim scratch between calls; the largest page id + 1
INT64_MAX = 2**63 - 1
# The most of anything a kernel indexes in chunks (pages, table cells, a batch's page ids, tokens):
# Triton computes a chunk's offsets ``start + lane`` in int32, so the count leaves room for a chunk.
MAX_INDEXED = 2**31 - 2**16

# Page states (int8, one per page).
FREE = 0      # on the free stack
USED = 1      # reference count >= 1
CACHED = 2    # reference count 0, content kept, evictable; carries an LRU stamp

# A page's generation (int32, one per page): +1 each time the page becomes FREE (a last
# reference dropped without ``cache``, an eviction), wrapping within the non-negative int32
# (``(g + 1) & GEN_MASK``). A prefix-cache entry records it; ``PageTable.revive`` compares.
GEN_MASK = 0x7FFFFFFF

NULL_PAGE = -1  # padding in every page-id tensor, in and out

# The LRU queue: a ring, int32 ``[LRU_FACTOR * P]`` page ids in the order pages became CACHED or
# were touched while CACHED, oldest first. Entries have absolute positions (int64, never reused
# while in the queue); position ``j`` lives in slot ``j % Q``. ``lru_pos[p]`` (int64 ``[P]``) is the
# position of page ``p``'s latest entry. The queue is ``[LRU_HEAD, LRU_HOLE) + [LRU_SCAN, LRU_TAIL)``:
# the gap ``[LRU_HOLE, LRU_SCAN)`` left by the cleaner (below) is never read. An entry ``j`` of the
# queue is live iff its page ``p`` is in ``[0, P)``, CACHED, and ``lru_pos[p] == j``; every other
# entry is stale and skipped. Eviction takes the first live entries and moves the head past them.
#
# Stale entries are removed a bounded amount at a time, never all at once. A call that pushes
# ``n`` entries (free/release with ``cache``, touch) then cleans, when the queue spans more than
# ``LRU_CLEAN_AT * P`` positions: the next ``LRU_CLEAN_RATE * n`` entries from ``LRU_SCAN`` are
# read, and the live ones move down to ``LRU_HOLE``, in order (both advance). When the scan
# reaches the tail, the tail comes back to the hole and the next pass starts at the head. A call
# that may push first checks the bounds (``0 <= head <= hole <= scan <= tail <= head + Q``, tail
# at most ``LRU_POS_LIMIT``; else the queue is emptied, one ``corrupt_state``) and room: when the
# span is past ``Q - P`` (a call pushes at most P entries, one per distinct page), the whole
# queue is compacted at once, the live entries moved down to the head. That is a fallback: in a
# simulation of touch-heavy and mixed workloads (batches up to P pages) the cleaner kept the span
# at or under ``3 P`` before every call and it never ran; it keeps a push from overwriting a live
# entry whatever the state holds.
LRU_FACTOR = 4
LRU_CLEAN_AT = 2
LRU_CLEAN_RATE = 4
LRU_POS_LIMIT = 2**62

# Slots of the int64 ``counters`` vector.
FREE_COUNT = 0       # pages on the free stack (stack top = FREE_COUNT)
CACHED_COUNT = 1     # pages in state CACHED
CLOCK = 2            # device clock: +1 per mutating call
USED_PEAK = 3        # peak of pages in state USED
CACHED_PEAK = 4      # peak of CACHED_COUNT
ALLOCATED = 5        # pages handed out by alloc, total
FREED = 6            # pages whose last reference was dropped, total
FAILED_REQUESTS = 7  # alloc requests answered ok=False, total
EVICTED = 8          # cached pages turned free by eviction, total
REVIVED = 9          # cached pages taken back into use by incref (prefix hits)
# Error counters: misuse, counted and never used as an address.
ERR_INVALID_PAGE = 10    # page id outside [0, num_pages) and not -1 (revive: also -1, a page named twice)
ERR_DOUBLE_FREE = 11     # free of a page that holds no reference
ERR_USE_AFTER_FREE = 12  # incref / touch of a FREE page
ERR_BAD_COUNT = 13       # negative count passed to alloc / extend
ERR_OUT_OVERFLOW = 14    # an output buffer too small (which one: OVERFLOW_* below)
ERR_BAD_REQUEST = 15     # page table: request id out of range
ERR_TABLE_OVERFLOW = 16  # page table: request would exceed max_pages_per_request
ERR_BAD_LENGTH = 17      # page table: truncate/fork to an invalid length
ERR_CORRUPT_STATE = 18   # a stored value (length, free count, stack entry) outside its static bounds
ERR_REFCOUNT_OVERFLOW = 19  # an incref or a fork would take a reference count past INT32_MAX
# The LRU queue (``PoolState.lru_queue``, positions, see above): ``[LRU_HEAD, LRU_HOLE)`` and
# ``[LRU_SCAN, LRU_TAIL)``.
LRU_HEAD = 20
LRU_TAIL = 21
LRU_HOLE = 22
LRU_SCAN = 23
# Which buffer an ``out_overflow`` overflowed: every count of ERR_OUT_OVERFLOW is counted again in
# one of these, so ``check()`` names the one argument to change.
OVERFLOW_PAGES = 24  # alloc: pages a request needs past its ``pages`` output, or requests past its lanes
OVERFLOW_SLOTS = 25  # extend / step: tokens past the ``slots`` output (max_tokens)
OVERFLOW_CSR = 26    # flashinfer_csr / step: page ids past the CSR's ``indices`` (capacity)
NUM_COUNTERS = 27

ERROR_NAMES = {
    ERR_INVALID_PAGE: "invalid_page",
    ERR_DOUBLE_FREE: "double_free",
    ERR_USE_AFTER_FREE: "use_after_free",
    ERR_BAD_COUNT: "bad_count",
    ERR_OUT_OVERFLOW: "out_overflow",
    ERR_BAD_REQUEST: "bad_request",
    ERR_TABLE_OVERFLOW: "table_overflow",
    ERR_BAD_LENGTH: "bad_length",
    ERR_CORRUPT_STATE: "corrupt_state",
    ERR_REFCOUNT_OVERFLOW: "refcount_overflow",
}
ERROR_SLOTS = {name: slot for slot, name in ERROR_NAMES.items()}
OVERFLOW_NAMES = {OVERFLOW_PAGES: "alloc_pages", OVERFLOW_SLOTS: "slots", OVERFLOW_CSR: "csr_indices"}

# A page table's CSR memo: int64 [memo_len(B)], made by the table with each set of
# CSR output buffers (one per call shape).
#   MEMO_WRITTEN: how far the last export into ``indices`` wrote, so the next one
#     re-pads only that far (every backend).
#   MEMO_VERSION: the table version the buffers hold the CSR of, -1 if none (numba step).
#   MEMO_IDS: [B] the batch they hold it for (numba step).
#   then [MEMO_INS_WIDTH * B] scratch: the lanes a step gave pages (numba step); a step that
#     keeps runs of an older CSR then writes there the blocks (source, destination, length)
#     it moves.
#   then [B] tails, from memo_tails(B): each lane's ``(last page << 32) | length`` after the
#     step (numba step), valid whenever MEMO_VERSION and MEMO_IDS are: the next step of the
#     batch reads a lane's length and last page there instead of in the table's rows.
#   then [B] stamps, from memo_stamps(B): each lane's row version (the table's
#     ``row_version[r]``) when the step wrote the CSR (numba step). A later step on these
#     buffers, whatever its batch, keeps the run of every request it finds in the old batch
#     (in order, at most KEEP_LOOKAHEAD old lanes past the previous one found) whose row
#     still has that stamp (its pages are unchanged, so its run in the old CSR is a prefix
#     of its new one).
#   then [B] plan: scratch where such a step notes, per lane, where the run it keeps starts in
#     the old CSR and how many pages it has.
#   then [B] kept, from memo_kept(B): scratch where it notes the last page of each run it
#     keeps (the old tail's page): a decode lane inside that page takes its slot from there
#     instead of reading the row, as a lane of an unchanged batch reads its tail.
MEMO_WRITTEN, MEMO_VERSION, MEMO_IDS = 0, 1, 2
KEEP_LOOKAHEAD = 8  # old lanes a kept run may lie past the previous kept one (requests that left between)
MEMO_INS_WIDTH = 4  # lane, end of its old pages in the old CSR, pages before, pages after


def memo_tails(b: int) -> int:
    return MEMO_IDS + (1 + MEMO_INS_WIDTH) * b


def memo_stamps(b: int) -> int:
    return MEMO_IDS + (2 + MEMO_INS_WIDTH) * b  # memo_tails(b) + b, written out (numba compiles it)


def memo_plan(b: int) -> int:
    return MEMO_IDS + (3 + MEMO_INS_WIDTH) * b


def memo_kept(b: int) -> int:
    return MEMO_IDS + (4 + MEMO_INS_WIDTH) * b


def memo_len(b: int) -> int:
    return MEMO_IDS + (5 + MEMO_INS_WIDTH) * b


# Descriptors of the numba kernels. A numba call checks every array argument it is
# given, so the addresses a kernel needs reach it packed in one int64 array, built once
# by ``tpool.backends.numba`` (the tensors never move).
#
# A pool's state descriptor (int64 [STATE_DESC_LEN]): addresses of its state tensors
# and the page count (SD_PAGE_GEN: the generations, read only by the calls that free or revive).
(SD_FREE_STACK, SD_REFCOUNT, SD_PAGE_STATE, SD_STAMP, SD_COUNTERS, SD_OCCUR, SD_KEYS, SD_PAGES, SD_PAGE_GEN,
 SD_LRU_QUEUE, SD_LRU_POS) = range(11)
STATE_DESC_LEN = 11

# A bound alloc's descriptor (int64 [AD_LEN]): the state descriptor, then an AllocOut's
# output addresses and capacities.
AD_PAGES, AD_MAX_PAGES, AD_INDPTR, AD_OK, AD_MAX_BATCH, AD_EVICTED = range(STATE_DESC_LEN, STATE_DESC_LEN + 6)
AD_LEN = STATE_DESC_LEN + 6

# A page table's descriptor (int64 [TABLE_DESC_LEN]). TD_VERSION is the address of the
# table's ``version`` cells (int64 [VERSION_CELLS], state, so a restored snapshot brings them
# back): the version at VERSION_NOW, and at APPENDED_FROM the version the table had before the
# step that made the current one, when that call was a step (which only appends: a memo of that
# version holds a CSR the next step can still grow in place, see kernels/step.py), else -1;
# TD_VERSION_SOURCE that of the process-wide version counter (see ``new_version``) and
# TD_ROW_VERSION that of ``row_version`` (int64 [R], state: the version of the call that last
# changed each row's pages, see ``stamp_rows``).
(TD_BLOCK_TABLE, TD_REQUESTS, TD_MAX_PAGES, TD_SEQ_LENS, TD_CLAIM, TD_PAGE_SIZE, TD_VERSION,
 TD_VERSION_SOURCE, TD_ROW_VERSION) = range(9)
TABLE_DESC_LEN = 9
VERSION_NOW, APPENDED_FROM = range(2)
VERSION_CELLS = 2

# A table call's descriptor (int64 [CALL_DESC_LEN]): the table descriptor, the pool's
# state descriptor, then the addresses of the table-owned output buffers the call writes.
# CD_CSR_MEMO is the address of the CSR memo kept with the ``indices`` buffer (MEMO_*
# above). A step bound to its input tensors too keeps their addresses and the batch size
# in CD_IDS, CD_NTOK, CD_LANES, and numba gets only the descriptor's address. A step's
# attention metadata: CD_POSITIONS (int32 [slots' length]), CD_QO_INDPTR (int32 [B+1]),
# CD_KV_LENS (int32 [B]). A bound step that releases requests first keeps the release ids'
# address, their count and the cache flag in CD_RELEASE, CD_RELEASE_LEN, CD_RELEASE_CACHE.
CD_STATE = TABLE_DESC_LEN
CD_OUT = TABLE_DESC_LEN + STATE_DESC_LEN
(CD_SLOTS, CD_SLOTS_LEN, CD_OK, CD_INDPTR, CD_INDICES, CD_INDICES_LEN, CD_LAST_PAGE_LEN,
 CD_CSR_MEMO, CD_IDS, CD_NTOK, CD_LANES, CD_POSITIONS, CD_QO_INDPTR, CD_KV_LENS,
 CD_RELEASE, CD_RELEASE_LEN, CD_RELEASE_CACHE) = range(CD_OUT, CD_OUT + 17)
CALL_DESC_LEN = CD_OUT + 17
