"""Paged K/V storage, step metadata and the reference paged attention (torch only, no transformers)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tpool
from conftest import i32
from tpool.serving import PagedKVCache, attention, paged_attention, step_metadata
from tpool.scheduling.mixed import MixedStep
from tpool.serving.kv import SCRATCH_PAGES
from tpool.testing import peak_alloc_bytes


def _cache(num_pages=6, page_size=4, layers=2, heads=2, dim=3, dtype=torch.float32):
    pool = tpool.PagePool(num_pages, page_size, device="cpu", backend="reference")
    return PagedKVCache.from_pool(pool, layers, heads, dim, dtype=dtype)


def test_views_are_nhd_and_contiguous_per_layer():
    c = _cache()
    assert c.layout == "NHD"
    for t in c.k + c.v:
        assert t.shape == (6, 4, 2, 3) and t.is_contiguous()
    assert c.k[1].data_ptr() != c.k[0].data_ptr()


def test_write_puts_tokens_at_their_slots_and_never_writes_padding(guard):
    c = _cache()
    slots = i32([5, -1, 23, 0, -1, 24, -7])   # 24 and -7 are outside [0, 24): written nowhere shown, counted
    k = torch.arange(7 * 2 * 3, dtype=torch.float32).view(7, 2, 3) + 1
    v = -k
    c.check()                                 # nothing counted yet
    with guard():
        c.write(1, slots, k, v)
    with pytest.raises(tpool.InvalidPage,
                       match=r"PagedKVCache: invalid_slot: 2\. Each is a slot outside \[0, 24\)") as e:
        c.check()
    assert e.value.counts == {"invalid_slot": 2}
    c.check()                                 # what a check raised is not raised again
    rows_k, rows_v = c.k[1].reshape(-1, 2, 3), c.v[1].reshape(-1, 2, 3)
    for i, s in enumerate([5, None, 23, 0, None, None, None]):
        if s is not None:
            assert torch.equal(rows_k[s], k[i]) and torch.equal(rows_v[s], v[i])
    written = torch.zeros(24, dtype=torch.bool)
    written[[5, 23, 0]] = True
    assert (rows_k[~written] == 0).all() and (rows_v[~written] == 0).all()   # incl. the last slot, 23 only as given
    assert (c.k[0] == 0).all() and (c.v[0] == 0).all()                          # other layers untouched
    # What the scratch page prevents: torch wraps -1 to the last slot of the last page.
    naive = torch.zeros(24, 2, 3)
    naive[i32([5, -1]).long()] = k[:2]
    assert torch.equal(naive[23], k[1])


def test_a_cache_made_under_inference_mode_is_written_outside_it():
    """Engines build their caches under torch.inference_mode(); the K/V storage and the misuse counters were
    then inference tensors, and every write, page copy and check outside that mode failed (torch refuses an
    in-place update of an inference tensor there)."""
    with torch.inference_mode():
        c = _cache(layers=1)
    k = torch.ones(2, 2, 3)
    c.write(0, i32([1, 99]), k, -k)                 # 99: outside, counted
    c.copy_pages(i32([0]), i32([2]))
    assert torch.equal(c.k[0].reshape(-1, 2, 3)[8 + 1], k[0])
    with pytest.raises(tpool.InvalidPage):
        c.check()
    assert not any(t.is_inference() for t in (c._k, c._v, c.misuse))


def test_check_works_under_another_default_device():
    """A loop run under ``with torch.device("cuda"):`` made check()'s host copy of the counts there (the pool's
    check was fixed for this, the K/V cache's was not): a CPU cache's check failed (the meta device stands
    for it here), or on a GPU machine made a CUDA context to subtract a few host ints."""
    c = _cache(layers=1)
    c.write(0, i32([1, 99]), torch.ones(2, 2, 3), torch.ones(2, 2, 3))   # 99: outside, counted
    with torch.device("meta"):
        with pytest.raises(tpool.InvalidPage) as info:
            c.check()
    assert info.value.counts == {"invalid_slot": 1} and c.misuse.tolist() == [0] * c.misuse.numel()
    c.check()                                       # read once: nothing left to raise


def test_write_accepts_transposed_inputs(guard):
    c = _cache(layers=1)
    k = torch.randn(2, 4, 3).transpose(0, 1)     # [4, 2, 3], non-contiguous, as a model hands it
    with guard():
        c.write(0, i32([1, 2, 3, 4]), k, k)
    assert torch.equal(c.k[0].reshape(-1, 2, 3)[1:5], k)


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.zeros(3, 2, 3, dtype=torch.float64)), "expected dtype torch.float32.*got torch.float64"),
    (dict(k=torch.zeros(3, 2, 4)), r"expected shape \(3, 2, 3\).*got \(3, 2, 4\)"),
    (dict(slots=torch.zeros(3, dtype=torch.int64)), "slots: expected dtype torch.int32, got torch.int64"),
    (dict(layer=2), r"layer: expected an int in \[0, 2\), got 2"),
])
def test_write_rejects_bad_input_naming_expected_and_actual(bad, match):
    c = _cache()
    args = dict(layer=0, slots=i32([0, 1, 2]), k=torch.zeros(3, 2, 3), v=torch.zeros(3, 2, 3)) | bad
    with pytest.raises(ValueError, match=match):
        c.write(args["layer"], args["slots"], args["k"], args["v"])
    assert all((t == 0).all() for t in c.k + c.v)


@pytest.mark.parametrize("bad", [dict(layer=5), dict(k=torch.zeros(3, 2, 3, dtype=torch.float64)),
                                 dict(v=torch.zeros(2, 2, 3))])
def test_a_refused_write_counts_no_bad_slot(bad):
    """A write refused with ValueError changes nothing: its bad slots were counted before the refusal, so the
    next check() raised InvalidPage for a call that had been refused."""
    c = _cache()
    args = dict(layer=0, slots=i32([0, 99, -5]), k=torch.zeros(3, 2, 3), v=torch.zeros(3, 2, 3)) | bad
    with pytest.raises(ValueError):
        c.write(args["layer"], args["slots"], args["k"], args["v"])
    c.check()   # nothing counted
    c.write(0, i32([0, 99, -5]), torch.zeros(3, 2, 3), torch.zeros(3, 2, 3))
    with pytest.raises(tpool.InvalidPage) as e:
        c.check()
    assert e.value.counts == {"invalid_slot": 2}   # one per bad slot of the call


def test_integer_kv_dtypes_are_refused_and_fp8_is_taken():
    """int8/uint8/bool K/V would need quantisation scales that nothing here applies: the cache used to
    take any 1-byte dtype as "fp8"; the float8 types are floating point and still taken."""
    for bad in (torch.int8, torch.uint8, torch.bool, torch.int32):
        with pytest.raises(ValueError, match=f"dtype: expected a floating torch.dtype.*got {bad}"):
            _cache(dtype=bad)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert _cache(dtype=fp8).k[0].dtype == fp8


def test_two_threads_checking_at_once_raise_the_counts_once():
    """check's read and its subtraction were two steps: two threads could both raise the same counts,
    and leave the counter negative (a phantom count at the next check)."""
    import sys
    import threading
    c = _cache()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(200):
            c.write(0, i32([99]), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
            raised, gate = [], threading.Barrier(2)

            def check():
                gate.wait()
                try:
                    c.check()
                except tpool.InvalidPage as e:
                    raised.append(e.counts)
            threads = [threading.Thread(target=check) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert raised == [{"invalid_slot": 1}] and c.misuse.tolist() == [0, 0, 0]
    finally:
        sys.setswitchinterval(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])  # (index_copy_ has no float8 kernel)
def test_copy_pages_copies_every_layer_and_skips_minus_one(guard, dtype):
    c = _cache(dtype=dtype)
    torch.manual_seed(0)
    for t in c.k + c.v:
        t.copy_(torch.randn(t.shape).to(dtype))
    raw = lambda ts: [t.view(torch.uint8) for t in ts]  # noqa: E731  (torch.equal has no float8 kernel either)
    before_k, before_v = [t.clone() for t in raw(c.k)], [t.clone() for t in raw(c.v)]
    with guard():
        c.copy_pages(i32([1, -1, 4, 2, 6, -1, 0]), i32([3, 0, -1, 5, 1, 9, -2]))  # the last three: outside
    # the message names the bound, the cache's pages (helper-204's mutation run: naming its slots passed)
    with pytest.raises(tpool.InvalidPage, match=rf"invalid_copy_page: 3\. Each is a page outside \[0, "
                                                rf"{c.num_pages}\), not -1, given to copy_pages") as e:
        c.check()
    assert e.value.counts == {"invalid_copy_page": 3}
    for layer in range(2):
        want_k, want_v = before_k[layer].clone(), before_v[layer].clone()
        want_k[3], want_v[3] = before_k[layer][1], before_v[layer][1]
        want_k[5], want_v[5] = before_k[layer][2], before_v[layer][2]
        assert torch.equal(raw(c.k)[layer], want_k) and torch.equal(raw(c.v)[layer], want_v)
    with pytest.raises(ValueError, match="dst: expected 2 entries, got 1"):
        c.copy_pages(i32([1, 2]), i32([3]))
    with pytest.raises(ValueError, match="dst: expected 1 entry, got 2"):
        c.copy_pages(i32([1]), i32([3, 4]))


def test_memory_bytes_counts_storage_and_shows_in_the_report():
    c = _cache(num_pages=6, page_size=4, layers=2, heads=2, dim=3)
    m = c.memory_bytes()
    per_page = 2 * 2 * 4 * 2 * 3 * 4                       # K and V, layers, tokens, heads, dim, fp32
    assert m["bytes_per_page"] == per_page and m["page_bytes"] == 6 * per_page
    assert m["storage_bytes"] == (6 + SCRATCH_PAGES) * per_page
    report = tpool.memory_report("cpu", pools=[c])
    assert list(report.tracked.pools.values())[0]["storage_bytes"] == m["storage_bytes"]


# ------------------------------------------------------------------ metadata
def test_step_metadata_by_hand(make_pool, guard):
    pool = make_pool(8, page_size=4)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0]), i32([3]), max_tokens=3)          # request 0 holds 3 tokens
    ids, ntok = i32([0, 1, -1]), i32([1, 2, 0])             # decode 1, prefill 2, a padding lane
    with guard():
        step = table.step(ids, ntok, max_tokens=4)
        meta = step_metadata(table, step)
    assert meta.positions.tolist() == [3, 0, 1, -1]          # the last slot is unused capacity
    assert meta.qo_indptr.tolist() == [0, 1, 3, 3]
    assert meta.kv_lens.tolist() == [4, 2, 0]
    assert meta.csr.indptr.tolist() == [0, 1, 2, 2] and meta.max_pages == 4
    assert (meta.page_size, meta.num_pages) == (4, 8)         # the pool's, for the attention to check
    assert all(t.dtype == torch.int32 for t in (meta.positions, meta.qo_indptr, meta.kv_lens))


def test_step_metadata_of_a_failed_lane(make_pool, guard):
    pool = make_pool(4, page_size=2)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0, 1]), i32([3, 1]), max_tokens=4)    # 2 pages + 1 page; 1 page left
    ids, ntok = i32([0, 1, 2]), i32([1, 4, 1])              # lane 1 needs 2 pages: fails, and so does lane 2
    with guard():
        step = table.step(ids, ntok, max_tokens=6)
        meta = step_metadata(table, step)
    assert step.ok.tolist() == [True, False, False]
    assert meta.positions.tolist() == [3, -1, -1, -1, -1, -1]   # a failed lane's tokens are padding
    assert meta.qo_indptr.tolist() == [0, 1, 5, 6]
    assert meta.kv_lens.tolist() == [4, 1, 0]                   # a failed lane keeps its length


# ------------------------------------------------------------------ attention
def _dense(q, ks, vs, positions, scale, window, softcap=None, sinks=None):
    """One sequence: q [n, Hq, D] at ``positions``, keys/values [L, Hkv, D] of the whole sequence;
    ``softcap`` and ``sinks`` as transformers' eager attention (Gemma2's, gpt-oss's) apply them."""
    hq, hkv = q.shape[1], ks.shape[1]
    k, v = ks.repeat_interleave(hq // hkv, 1), vs.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    key = torch.arange(ks.shape[0])
    mask = key[None, :] <= positions[:, None]
    if window is not None:
        mask &= key[None, :] > positions[:, None] - window
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = s.softmax(-1)
    else:
        p = torch.cat([s, sinks[:, None, None].expand(-1, s.shape[1], 1)], -1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("option", [None, "softcap", "sinks"])
@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_matches_dense_attention_per_sequence(make_pool, guard, window, option):
    torch.manual_seed(0)
    ps, hq, hkv, d = 4, 6, 2, 8
    pool = make_pool(32, page_size=ps)
    table = tpool.PageTable(pool, 4, 6)
    cache = PagedKVCache.from_pool(pool, 1, hkv, d, dtype=torch.float32)
    history = {0: 9, 2: 5}                                     # requests 0 and 2 already hold tokens
    full_k = {r: torch.randn(24, hkv, d) for r in range(4)}
    full_v = {r: torch.randn(24, hkv, d) for r in range(4)}
    for r, n in history.items():
        res = table.extend(i32([r]), i32([n]), max_tokens=n)
        cache.write(0, res.slots, full_k[r][:n], full_v[r][:n])
    ids, ntok = i32([2, 0, 1, -1, 3]), i32([1, 2, 7, 0, 1])    # decode, 2 drafted, prefill, padding, prefill of 1
    lens0 = {2: 5, 0: 9, 1: 0, 3: 0}
    t = 12
    step = table.step(ids, ntok, max_tokens=t)
    meta = step_metadata(table, step)
    k_new = torch.cat([full_k[r][lens0[r]:lens0[r] + n] for r, n in ((2, 1), (0, 2), (1, 7), (3, 1))])
    v_new = torch.cat([full_v[r][lens0[r]:lens0[r] + n] for r, n in ((2, 1), (0, 2), (1, 7), (3, 1))])
    pad = t - k_new.shape[0]
    q = torch.randn(t, hq, d) * 3                              # scores past a softcap of 2
    scale = 0.3
    extra = {None: {}, "softcap": {"softcap": 2.0}, "sinks": {"sinks": torch.randn(hq) * 2}}[option]
    with guard():
        cache.write(0, meta.slots, torch.cat([k_new, torch.zeros(pad, hkv, d)]),
                    torch.cat([v_new, torch.zeros(pad, hkv, d)]))
        out = paged_attention(q, cache.k[0], cache.v[0], meta, scale=scale, sliding_window=window, **extra)
    start = 0
    for r, n in ((2, 1), (0, 2), (1, 7), (3, 1)):
        L = lens0[r] + n
        pos = torch.arange(lens0[r], L)
        want = _dense(q[start:start + n], full_k[r][:L], full_v[r][:L], pos, scale, window, **extra)
        torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)
        start += n
    assert (out[start:] == 0).all()                             # padding tokens get zeros
    default = paged_attention(q, cache.k[0], cache.v[0], meta, sliding_window=window, **extra)
    assert not torch.allclose(default, out) and math.isclose(1 / math.sqrt(d), d ** -0.5)
    if option:                                                  # the option changes the result
        assert not torch.allclose(paged_attention(q, cache.k[0], cache.v[0], meta, scale=scale,
                                                  sliding_window=window), out, atol=1e-3)


@pytest.mark.parametrize("option", [None, "softcap", "sinks"])
def test_non_finite_values_in_slots_a_lane_does_not_hold_never_reach_its_output(make_pool, guard, option):
    """Keys a token may not see weigh 0, but 0 * inf is NaN: the stale tail of a reused page, the pages
    gathered as padding (another request's page 0) and every free page may hold anything (an overflowed
    half-precision value, NaN from an earlier model); the output is the one with zeros there, bit for bit.
    (The values were multiplied by their zero weight: every token of every lane came out NaN.)"""
    torch.manual_seed(2)
    pool = make_pool(8, page_size=4)
    table = tpool.PageTable(pool, 2, 3)
    cache = PagedKVCache.from_pool(pool, 1, 1, 2, dtype=torch.float32)
    meta = step_metadata(table, table.step(i32([0, 1]), i32([2, 3]), max_tokens=6))   # one padding token
    cache.write(0, meta.slots, torch.randn(6, 1, 2), torch.randn(6, 1, 2))
    q = torch.randn(6, 2, 2)
    extra = {None: {}, "softcap": {"softcap": 2.0}, "sinks": {"sinks": torch.randn(2)}}[option]
    with guard():
        clean = paged_attention(q, cache.k[0], cache.v[0], meta, **extra)
    held = torch.zeros(8 * 4, dtype=torch.bool)
    held[meta.slots[meta.slots >= 0].long()] = True
    for x, bad in ((cache.k[0], float("nan")), (cache.v[0], float("inf"))):
        x.view(-1, 2)[~held] = bad
    with guard():
        dirty = paged_attention(q, cache.k[0], cache.v[0], meta, **extra)
    assert torch.isfinite(clean).all() and clean[:5].ne(0).any(-1).all()
    assert torch.equal(dirty, clean)


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_forks_truncations_and_reused_pages_attend_as_dense_attention(page_size):
    """Random steps (prefill, decode and padding lanes, lengths ending on a page boundary and one past
    it), forks with their copy-on-write copy, truncations that leave stale K/V in a page, releases whose
    pages come back in another order; the pages start as NaN. Each granted lane's output is dense
    attention over its own sequence so far, and every request's pages still hold exactly its K/V (no
    write, padding or copy landed in a page another request holds)."""
    import random
    rng, hkv, hq, d, mp, rows = random.Random(page_size), 2, 4, 3, -(-20 // page_size), 4
    torch.manual_seed(page_size)
    pool = tpool.PagePool(rows * mp + 2, page_size, device="cpu", backend="reference")
    n = pool.num_pages
    # The free stack shuffled, the last page on top: the first request takes it, where a padding slot -1
    # wrapped by torch (the last slot) would land.
    pool.alloc(i32([n]))
    pool.free(torch.cat([torch.randperm(n - 1), torch.tensor([n - 1])]).to(torch.int32))
    table = tpool.PageTable(pool, rows, mp)
    cache = PagedKVCache.from_pool(pool, 1, hkv, d, dtype=torch.float32)
    cache.k[0].fill_(float("nan"))
    cache.v[0].fill_(float("nan"))
    seqs, seen = {}, dict(cow=0, truncate=0, checked=0)       # row -> (keys, values) of its tokens
    for _ in range(40):
        op = rng.random()
        if op < 0.15 and seqs:
            r = rng.choice(sorted(seqs))
            keep = rng.randint(0, len(seqs[r][0]))
            table.truncate(i32([r]), i32([keep]))
            if int(table.seq_lens[r]) == keep:
                seqs[r] = (seqs[r][0][:keep], seqs[r][1][:keep])
                seen["truncate"] += 1
            else:                                             # refused: it ended inside a page a fork shares
                with pytest.raises(tpool.InvalidLength):
                    pool.check()
            continue
        if op < 0.3 and seqs and len(seqs) < rows:
            src, dst = rng.choice(sorted(seqs)), min(set(range(rows)) - set(seqs))
            share = rng.randint(0, len(seqs[src][0]))
            fork = table.fork(i32([src]), i32([dst]), i32([share]))
            cache.copy_pages(fork.cow_src, fork.cow_dst)
            seqs[dst] = (seqs[src][0][:share], seqs[src][1][:share])
            seen["cow"] += int(fork.cow_dst[0]) >= 0
            continue
        if op < 0.4 and seqs:
            r = rng.choice(sorted(seqs))
            table.release(i32([r]))
            del seqs[r]
            continue
        lanes = []
        for r in rng.sample(range(rows), rng.randint(1, rows)):
            have = len(seqs.get(r, ((),))[0])
            room = mp * page_size - have
            if room:
                edge = (have // page_size + 1) * page_size + rng.choice([0, 1]) - have  # to a boundary, or past it
                lanes.append((r, min(room, rng.choice([1, rng.randint(1, 7), edge]))))
        lanes.insert(rng.randint(0, len(lanes)), (-1, 0))
        t = sum(k for _, k in lanes) + rng.randint(0, 2)
        meta = step_metadata(table, table.step(i32([r for r, _ in lanes]), i32([k for _, k in lanes]), max_tokens=t))
        k_new, v_new, q = torch.randn(t, hkv, d), torch.randn(t, hkv, d), torch.randn(t, hq, d)
        cache.write(0, meta.slots, k_new, v_new)
        out = paged_attention(q, cache.k[0], cache.v[0], meta)
        qo = meta.qo_indptr.tolist()
        assert (out[qo[-1]:] == 0).all()
        for i, (r, _) in enumerate(lanes):
            a, b = qo[i], qo[i + 1]
            if r < 0:
                continue
            ks, vs = seqs.get(r, (torch.zeros(0, hkv, d),) * 2)
            seqs[r] = (torch.cat([ks, k_new[a:b]]), torch.cat([vs, v_new[a:b]]))
            want = _dense(q[a:b], *seqs[r], torch.arange(len(ks), len(ks) + b - a), d ** -0.5, None)
            torch.testing.assert_close(out[a:b], want, atol=1e-5, rtol=1e-5)
            seen["checked"] += b - a
        for r, (ks, vs) in seqs.items():
            pages = table.block_table[r, :-(-len(ks) // page_size)].long()
            assert torch.equal(cache.k[0][pages].flatten(0, 1)[:len(ks)], ks)
            assert torch.equal(cache.v[0][pages].flatten(0, 1)[:len(ks)], vs)
    pool.check()
    cache.check()
    assert (seen["cow"] or page_size == 1) and seen["truncate"] and seen["checked"] > 100, seen   # (1: no CoW)


class _LargestTensor(TorchDispatchMode):
    """Inside the block: the bytes of the largest tensor any op returned (``numel * element_size``)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor):
                self.nbytes = max(self.nbytes, x.numel() * x.element_size())
        return out


@pytest.mark.parametrize("option", [None, "softcap", "sinks"])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_in_chunks_bounds_memory_and_matches_one_chunk(make_pool, guard, monkeypatch, window,
                                                                        option):
    """A step whose whole gather (12 tokens x 32 keys x 2 heads x 8 dims, float32: 24 KiB) exceeds the
    budget runs in chunks of ``chunk_tokens`` tokens, every op's output within the budget, and gives
    the one-chunk result bit for bit: 2, 3 and 5 tokens a chunk (12 = 5 + 5 + 2: the last chunk is
    tokens 7..11, 7..9 kept from the one before) and a budget under two tokens (2 a chunk)."""
    torch.manual_seed(1)
    ps, mp, hq, hkv, d, t = 4, 8, 6, 2, 8, 12
    pool = make_pool(32, page_size=ps)
    table = tpool.PageTable(pool, 4, mp)
    cache = PagedKVCache.from_pool(pool, 1, hkv, d, dtype=torch.float32)
    res = table.extend(i32([0, 2]), i32([13, 4]), max_tokens=17)          # histories of 13 and 4 tokens
    cache.write(0, res.slots, torch.randn(17, hkv, d), torch.randn(17, hkv, d))
    meta = step_metadata(table, table.step(i32([2, 0, 1, -1]), i32([1, 2, 7, 0]), max_tokens=t))  # 2 padding
    cache.write(0, meta.slots, torch.randn(t, hkv, d), torch.randn(t, hkv, d))
    q = torch.randn(t, hq, d) * 3
    extra = {None: {}, "softcap": {"softcap": 2.0}, "sinks": {"sinks": torch.randn(hq) * 2}}[option]
    keys, scores = mp * ps * hkv * d * 4, (mp * ps + 1) * hq * 4             # bytes of one token's keys, scores
    per_token = max(2 * keys + scores + hq * d * 4, 3 * scores) + 24 * mp * ps   # chunk_tokens' count of a token
    chunks = []
    chunk = attention._attend_chunk
    monkeypatch.setattr(attention, "_attend_chunk", lambda qg, *a: chunks.append(qg.shape[0]) or chunk(qg, *a))

    def run(budget):
        chunks.clear()
        with guard(), _LargestTensor() as largest:
            out = paged_attention(q, cache.k[0], cache.v[0], meta, sliding_window=window, chunk_bytes=budget,
                                  **extra)
        return out, largest.nbytes, list(chunks)

    whole, whole_peak, whole_chunks = run(1 << 30)
    assert whole_chunks == [t] and whole_peak >= t * keys                     # one chunk: all keys at once
    assert whole.abs().sum(-1).sum(-1).ne(0).tolist() == [True] * 10 + [False] * 2   # padding tokens: zeros
    for budget, c in ((per_token * 3, 3), (per_token * 5 + 7, 5), (per_token * 2, 2), (per_token - 1, 2)):
        assert attention.chunk_tokens(t, mp * ps, hkv, d, hq, budget) == c
        out, peak, ran = run(budget)
        assert ran == [c] * -(-t // c)                                      # ceil(t / c) chunks, all of c tokens
        assert peak <= max(budget, 2 * per_token) and peak < whole_peak
        assert torch.equal(out, whole)


@pytest.mark.parametrize("heads", [(8, 2, 16), (4, 4, 8), (64, 1, 1)])   # GQA, MHA, scores larger than keys
@pytest.mark.parametrize("page_size, max_pages", [(1, 64), (16, 4), (64, 1)])
def test_paged_attention_temporaries_stay_within_chunk_bytes(page_size, max_pages, heads):
    """The bytes a real call allocates, all of them at once (not tensor by tensor), stay within
    ``chunk_bytes`` plus what the call holds outside its chunks (q and the output in float32,
    ``[T, Hq, D]`` each, the result in q's dtype, int64 page ids and token indices). The budget is a quarter of a
    one-chunk call's peak, so several chunks of 3 or more tokens run (the two-token floor excuses
    nothing). Before chunk_tokens counted every temporary, it sized a chunk by its largest tensor
    alone while keys, values, einsum's copies of them, the masked values and two score tensors were
    alive together: 3 to 4.6 times the budget; and a float64 cache's gather beside its float32 copy,
    uncounted, took 1.3 times it."""
    torch.manual_seed(0)
    hq, hkv, d = heads
    ps, mp, t = page_size, max_pages, 32
    span = mp * ps
    for dtype, window, extra in ((torch.float32, None, {}), (torch.float32, 5, {"softcap": 2.0}),
                                 (torch.float32, None, {"sinks": torch.randn(hq)}), (torch.bfloat16, None, {}),
                                 (torch.float64, None, {})):
        pool = tpool.PagePool(4 * mp, ps, device="cpu", backend="reference")
        table = tpool.PageTable(pool, 4, mp)
        cache = PagedKVCache.from_pool(pool, 1, hkv, d, dtype=dtype)
        hist = span - t                                                       # a lane whose pages fill its row
        res = table.extend(i32([0]), i32([hist]), max_tokens=hist)
        cache.write(0, res.slots, torch.randn(hist, hkv, d, dtype=dtype), torch.randn(hist, hkv, d, dtype=dtype))
        meta = step_metadata(table, table.step(i32([0, 1, -1]), i32([1, t - 2, 0]), max_tokens=t))  # 1 padding
        cache.write(0, meta.slots, torch.randn(t, hkv, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype))
        q = torch.randn(t, hq, d, dtype=dtype)

        def call(budget):
            return paged_attention(q, cache.k[0], cache.v[0], meta, sliding_window=window, chunk_bytes=budget,
                                   **extra)

        with torch.no_grad():
            whole = call(1 << 40)
            budget = peak_alloc_bytes(lambda: call(1 << 40)) // 4
            c = attention.chunk_tokens(t, span, hkv, d, hq, budget)
            assert 3 <= c < t
            # q and the output in float32, the result in q's dtype (not float32), page ids and indices
            outside = t * hq * d * (8 + q.element_size() * (dtype != torch.float32)) + 8 * (3 * mp + 8 * t)
            peak = peak_alloc_bytes(lambda: call(budget))
            assert peak <= budget + outside, (dtype, window, list(extra), c, peak, budget + outside)
            assert torch.equal(call(budget), whole)


def test_paged_attention_rejects_mismatched_heads():
    pool = tpool.PagePool(4, 2, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 2, 2)
    cache = PagedKVCache.from_pool(pool, 1, 2, 4, dtype=torch.float32)
    ids, ntok = i32([0]), i32([1])
    meta = step_metadata(table, table.step(ids, ntok))
    with pytest.raises(ValueError, match="multiple of num_kv_heads 2, got 3"):
        paged_attention(torch.zeros(1, 3, 4), cache.k[0], cache.v[0], meta)
    with pytest.raises(ValueError, match="expected 1 tokens .*got 2"):
        paged_attention(torch.zeros(2, 4, 4), cache.k[0], cache.v[0], meta)
    with pytest.raises(ValueError, match=r"sinks: expected a \(4,\) tensor .*got \(2,\)"):
        paged_attention(torch.zeros(1, 4, 4), cache.k[0], cache.v[0], meta, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="softcap: expected a positive number or None, got 0"):
        paged_attention(torch.zeros(1, 4, 4), cache.k[0], cache.v[0], meta, softcap=0)
    for window in (0, -2, 2.5, True):   # 0 and below masked every key: rows of zeros, no error
        with pytest.raises(ValueError, match=rf"sliding_window: expected None or an int >= 1 .*got {window}"):
            paged_attention(torch.zeros(1, 4, 4), cache.k[0], cache.v[0], meta, sliding_window=window)
    for chunk in (0, 1.5):
        with pytest.raises(ValueError, match=rf"chunk_bytes: expected a positive int, got {chunk}"):
            paged_attention(torch.zeros(1, 4, 4), cache.k[0], cache.v[0], meta, chunk_bytes=chunk)


@pytest.mark.parametrize("num_pages, page_size", [(8, 2), (2, 4)])   # more pages; as many slots, larger pages
def test_paged_attention_refuses_pages_other_than_the_tables(num_pages, page_size):
    """Slots of the table's page size read through pages of another size would attend to the wrong
    keys with no error (a pool of 4 pages of 2 here)."""
    pool = tpool.PagePool(4, 2, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 2, 2)
    meta = step_metadata(table, table.step(i32([0]), i32([3]), max_tokens=3))
    other = PagedKVCache(1, num_pages, page_size, 2, 4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=f"k_cache: expected 4 pages of 2 tokens .*got {num_pages} pages of "
                                         f"{page_size}"):
        paged_attention(torch.zeros(3, 4, 4), other.k[0], other.v[0], meta)


def test_objects_of_another_kind_are_refused_naming_what_was_expected():
    """A newcomer's likely slips (the step's result where its metadata goes, the pool or the mirror's step
    where the table or the table's step goes, a cache's list of layers for one layer) got an AttributeError
    from deep inside (``'StepResult' object has no attribute 'num_pages'``); each is a ValueError naming the
    object expected and the one given, before any tensor is touched."""
    pool = tpool.PagePool(8, 4, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 2, 4)
    res = table.step(i32([0, 1]), i32([3, 2]), max_tokens=6)
    with pytest.raises(ValueError, match=r"table: expected a PageTable \(the one that ran the step\), got PagePool"):
        step_metadata(pool, res)
    for bad, got in ((None, "NoneType"), (res.csr, "PagedKVCSR"), (table, "PageTable")):
        with pytest.raises(ValueError, match=f"step: expected a StepResult \\(what table.step returns.*got {got}"):
            step_metadata(table, bad)
    with pytest.raises(ValueError, match=r"step: expected a StepResult .*got MixedStep: pass its \.result"):
        step_metadata(table, MixedStep([], res, i32([0, 1]), i32([3, 2])))   # HostMirror.step's result
    meta = step_metadata(table, res)
    cache = PagedKVCache.from_pool(pool, 1, 1, 4, dtype=torch.float32)
    q = torch.zeros(6, 2, 4)
    for bad, got in ((res, "StepResult: pass step_metadata\\(table, step\\)"), (None, "NoneType")):
        with pytest.raises(ValueError, match=f"meta: expected a StepMetadata \\(step_metadata\\(table, step\\)\\), "
                                             f"got {got}"):
            paged_attention(q, cache.k[0], cache.v[0], bad)
    with pytest.raises(ValueError, match=r"k_cache, v_cache: expected two \[num_pages, page_size, num_kv_heads, "
                                         r"head_dim\] tensors .*got list and list"):
        paged_attention(q, cache.k, cache.v, meta)
    assert paged_attention(q, cache.k[0], cache.v[0], meta).shape == (6, 2, 4)


def test_from_pool_refuses_what_is_not_a_pool_naming_it():
    """``PagedKVCache.from_pool(table, ...)`` (the table where its pool goes) raised ``AttributeError: 'PageTable'
    object has no attribute 'num_pages'``; a ValueError names what was expected, and for a table where its pool is."""
    pool = tpool.PagePool(8, 4, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 2, 4)
    with pytest.raises(ValueError, match=r"pool: expected a PagePool, got PageTable \(its pool is table.pool\)"):
        PagedKVCache.from_pool(table, 1, 1, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"pool: expected a PagePool, got NoneType$"):
        PagedKVCache.from_pool(None, 1, 1, 4, dtype=torch.float32)
    assert PagedKVCache.from_pool(table.pool, 1, 1, 4, dtype=torch.float32).num_pages == 8


@pytest.mark.parametrize("module", ["kv", "attention"])
def test_docstring_examples(module):
    import doctest
    import importlib
    mod = importlib.import_module(f"tpool.serving.{module}")
    globs = {"torch": torch, "PagePool": tpool.PagePool, "PageTable": tpool.PageTable}
    result = doctest.testmod(mod, extraglobs=globs, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 3 and result.failed == 0


def test_tpool_and_its_serving_core_never_import_transformers():
    import subprocess
    import sys
    code = ("import sys, tpool, tpool.serving, tpool.serving.kv, tpool.serving.attention; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


class _RecordingWrapper:
    """Stands in for one of flashinfer's wrapper classes on a CPU: records what ``plan`` is given
    and returns ones from ``run``. It checks only tpool's side of the call (the arguments it
    builds from a step); FlashInfer's kernels run in test_serving.py's GPU test."""

    def __init__(self, workspace, layout):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.planned = None

    def plan(self, *args, **kwargs):
        self.planned = args, kwargs

    def run(self, q, kv):
        return torch.ones_like(q)


def _recorded_flashinfer_plan(monkeypatch):
    """A FlashInferAttention on recording wrappers, planned for a step of 4 tokens (decode, prefill,
    padding lane, unused row) with 2 query heads, 1 KV head, head_dim 8, pages of 4, float16."""
    import sys
    import types
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.BatchPrefillWithPagedKVCacheWrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper = _RecordingWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    from tpool.serving import FlashInferAttention
    pool = tpool.PagePool(8, page_size=4, device="cpu", backend="numba")
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0]), i32([3]), max_tokens=3)
    step = table.step(i32([0, 1, -1]), i32([1, 2, 0]), max_tokens=4)   # decode, prefill, padding
    meta = step_metadata(table, step)
    fi = FlashInferAttention("cpu", workspace_bytes=16)
    plan = dict(num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4, q_dtype=torch.float16,
                kv_dtype=torch.float16)
    fi.plan(meta, **plan)
    return fi, meta, plan


def test_flashinfer_plan_gives_empty_lanes_no_kv_and_zeroes_failed_rows(monkeypatch):
    fi, meta, plan = _recorded_flashinfer_plan(monkeypatch)
    args, kwargs = fi._prefill.planned
    assert args[0].tolist() == [0, 1, 3, 3] and args[1].tolist() == [0, 1, 2, 2]
    assert args[3].tolist() == [4, 2, 0]            # the padding lane: last page length 0 (CSR says 4)
    assert meta.csr.last_page_len.tolist() == [4, 2, 4] and kwargs["causal"] is True
    cache = torch.zeros(8, 4, 1, 8, dtype=torch.float16)
    out = fi.run(torch.zeros(4, 2, 8, dtype=torch.float16), cache, cache)
    assert out[:, 0, 0].tolist() == [1, 1, 1, 0]     # the unused row (position -1) is zeros
    with pytest.raises(ValueError, match="exactly one token per lane"):
        fi.plan(meta, **plan, decode=True)
    with pytest.raises(ValueError, match="float16"):
        fi.plan(meta, **{**plan, "q_dtype": torch.float32})
    fi.plan(meta, **{k: v for k, v in plan.items() if k != "page_size"})   # the pool's, from the metadata
    assert fi._prefill.planned[0][7] == 4
    with pytest.raises(ValueError, match="page_size: expected 4"):
        fi.plan(meta, **{**plan, "page_size": 8})


def test_flashinfer_run_refuses_inputs_that_differ_from_the_plan(monkeypatch):
    """A q or a cache that does not match the plan gets a ValueError naming both sizes, not torch's
    broadcast error, and FlashInfer is never called with it."""
    fi, meta, plan = _recorded_flashinfer_plan(monkeypatch)
    calls = []
    fi._prefill.run = lambda q, kv: calls.append(q.shape) or torch.ones_like(q)
    q = torch.zeros(4, 2, 8, dtype=torch.float16)
    cache = torch.zeros(8, 4, 1, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"q: expected 4 tokens .*got 3"):
        fi.run(q[:3], cache, cache)                          # fewer rows than the step's tokens
    with pytest.raises(ValueError, match=r"q: expected 4 tokens .*got 5"):
        fi.run(torch.zeros(5, 2, 8, dtype=torch.float16), cache, cache)
    with pytest.raises(ValueError, match=r"q: expected \[T, 2, 8\] torch.float16 .*got \[4, 4, 8\]"):
        fi.run(torch.zeros(4, 4, 8, dtype=torch.float16), cache, cache)   # 4 query heads, planned 2
    with pytest.raises(ValueError, match=r"got \[4, 2, 8\] torch.bfloat16"):
        fi.run(q.bfloat16(), cache, cache)
    with pytest.raises(ValueError, match=r"k_cache, v_cache: expected \[num_pages, 4, 1, 8\] .*got \[8, 2, 1, 8\]"):
        fi.run(q, cache[:, :2], cache[:, :2])                # pages of 2, planned 4
    with pytest.raises(ValueError, match=r"k_cache, v_cache: expected two .* got \(8, 4, 1, 8\) and \(8, 4, 2, 8\)"):
        fi.run(q, cache, torch.zeros(8, 4, 2, 8, dtype=torch.float16))
    assert calls == []
    assert fi.run(q, cache, cache)[:, 0, 0].tolist() == [1, 1, 1, 0] and calls == [(3, 2, 8)]


def test_flashinfer_as_attend_refuses_what_it_was_not_planned_for(monkeypatch):
    """``PagedContext(..., attend=fi)``: a layer asking for a softcap, sinks, another window or scale,
    another step, or pages of another pool gets a ValueError, and FlashInfer is never called."""
    fi, meta, plan = _recorded_flashinfer_plan(monkeypatch)
    calls = []
    fi._prefill.run = lambda q, kv: calls.append(q.shape) or torch.ones_like(q)
    q = torch.zeros(4, 2, 8, dtype=torch.float16)
    cache = torch.zeros(8, 4, 1, 8, dtype=torch.float16)
    for kwargs, match in (({"softcap": 5.0}, "softcap: FlashInferAttention does not implement it"),
                          ({"sinks": torch.zeros(2)}, r"sinks: .*got \(2,\)"),
                          ({"sliding_window": 4}, "sliding_window: expected None .*got 4"),
                          ({"scale": 0.1}, r"scale: expected 0.35355.* \(given to plan\), got 0.1")):
        with pytest.raises(ValueError, match=match):
            fi(q, cache, cache, meta, **kwargs)
    other = tpool.PageTable(tpool.PagePool(8, 4, device="cpu", backend="reference"), 4, 4)
    with pytest.raises(ValueError, match="meta: expected the step metadata given to plan"):
        fi(q, cache, cache, step_metadata(other, other.step(i32([0]), i32([1]), max_tokens=4)))
    with pytest.raises(ValueError, match="k_cache: expected 8 pages of 4 tokens .*got 6 pages of 4"):
        fi(q, cache[:6], cache[:6], meta)                      # the plan's page size, another page count
    assert calls == []
    assert fi(q, cache, cache, meta, scale=8 ** -0.5)[:, 0, 0].tolist() == [1, 1, 1, 0] and calls == [(3, 2, 8)]


def _past_capacity_step(backend="numba"):
    """A step whose CSR (capacity 1) holds lane 0's page only: lane 1, a prefill of 2 tokens, is granted
    (valid positions) but exported with no pages and ``kv_lens`` 0; lane 2 is padding."""
    pool = tpool.PagePool(8, page_size=4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0]), i32([3]), max_tokens=3)
    step = table.step(i32([0, 1, -1]), i32([1, 2, 0]), max_tokens=4, capacity=1)
    meta = step_metadata(table, step)
    assert meta.positions.tolist() == [3, 0, 1, -1] and meta.kv_lens.tolist() == [4, 0, 0]
    return table, meta


def test_paged_attention_gives_zeros_for_lanes_past_the_csr_capacity(make_pool, guard):
    """Capacity 0: every lane exported empty, and an empty ``indices`` (an IndexError before)."""
    pool = make_pool(8, page_size=4)
    table = tpool.PageTable(pool, 2, 4)
    with guard():
        step = table.step(i32([0]), i32([3]), max_tokens=4, capacity=0)
        meta = step_metadata(table, step)
        cache = PagedKVCache.from_pool(pool, 1, 1, 2, dtype=torch.float32)
        cache.k[0].normal_()
        cache.v[0].normal_()
        out = paged_attention(torch.randn(4, 1, 2), cache.k[0], cache.v[0], meta)
    assert meta.csr.indices.numel() == 0 and meta.kv_lens.tolist() == [0]
    assert out.shape == (4, 1, 2) and not out.any()
    _, meta = _past_capacity_step()
    cache = PagedKVCache.from_pool(tpool.PagePool(8, page_size=4, device="cpu"), 1, 1, 2, dtype=torch.float32)
    cache.v[0].fill_(1.0)
    out = paged_attention(torch.randn(4, 1, 2), cache.k[0], cache.v[0], meta)
    assert out[:, 0, 0].tolist() == [1, 0, 0, 0]     # lane 0 attends (values all 1), lane 1 and padding: zeros


def test_flashinfer_zeroes_the_rows_of_lanes_past_the_csr_capacity_as_the_reference(monkeypatch):
    """A lane the CSR had no room for has valid positions but ``kv_lens`` 0: the reference answers its
    tokens with zeros, and so must ``run`` (it zeroed only rows at position -1 before)."""
    fi, _, plan = _recorded_flashinfer_plan(monkeypatch)
    _, meta = _past_capacity_step()
    fi.plan(meta, **plan)
    cache = torch.zeros(8, 4, 1, 8, dtype=torch.float16)
    assert fi.run(torch.zeros(4, 2, 8, dtype=torch.float16), cache, cache)[:, 0, 0].tolist() == [1, 0, 0, 0]
    ref = paged_attention(torch.ones(4, 2, 8), torch.ones(8, 4, 1, 8), torch.ones(8, 4, 1, 8), meta)
    assert ref[:, 0, 0].tolist() == [1, 0, 0, 0]


def _transformers_config(model_type, **kw):
    """A tiny config of ``model_type`` (nothing downloaded); skips where transformers lacks the type."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} config")
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    return transformers.AutoConfig.for_model(model_type, **{**common, **kw})


@pytest.mark.parametrize("v_head_dim, words", [(8, "(K and V head dims differ)"), (16, "not the 2 K/V heads")])
def test_kv_shape_refuses_multi_head_latent_attention(v_head_dim, words):
    """DeepSeek-V3's MLA caches K and V per query head with their own head dims: ``kv_shape`` returned
    ``(2, 2, 8)`` and the first write failed with ``k: expected shape (64, 2, 8) ..., got (64, 4, 16)``."""
    from types import SimpleNamespace

    from tpool.serving import engine
    cfg = _transformers_config("deepseek_v3", kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                               qk_nope_head_dim=8, v_head_dim=v_head_dim, n_routed_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1)
    with pytest.raises(ValueError, match="deepseek_v3: not supported by tpool.serving: multi-head latent") as e:
        engine.kv_shape(cfg)
    assert words in str(e.value) and "4 query heads, K of head dim 16" in str(e.value)
    with pytest.raises(ValueError, match="deepseek_v3: not supported"):   # the Engine says it before any step
        engine.Engine(SimpleNamespace(config=cfg, dtype=torch.float32), num_pages=8, page_size=4, max_batch=2,
                      max_pages=4, backend="reference")


def test_kv_shape_refuses_head_dims_that_differ_per_layer():
    """Gemma 4's full-attention layers have their own head_dim (a transformers ``per_layer_config``):
    ``kv_shape`` raised transformers' ``AmbiguousGlobalPerLayerAttributeError`` reading ``head_dim``."""
    from tpool.serving import engine
    kw = dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    cfg = _transformers_config("gemma4_text", global_head_dim=32, **kw)
    with pytest.raises(ValueError, match="gemma4_text: not supported by tpool.serving: its head dims") as e:
        engine.kv_shape(cfg)
    assert "layers [0]: 2 K/V heads of head_dim 16; layers [1]: 2 K/V heads of head_dim 32" in str(e.value)
    # Layers that all agree are one shape, per-layer config or not.
    assert engine.kv_shape(_transformers_config("gemma4_text", global_head_dim=16, **kw)) == (2, 2, 16)
    assert engine.kv_shape(_transformers_config("llama", head_dim=16)) == (2, 2, 16)


# --- Pinned by helper-142's mutation run over tpool/serving (session 39) -------------------------------------------

def test_destinations_send_padding_and_bad_slots_to_the_scratch_pages_first_row():
    """-1 (padding) and a slot outside the pool both become the scratch page's first row (24 here: 6 pages
    of 4); only the bad slot is counted."""
    c = _cache(layers=1, heads=1, dim=1)
    rows = c.destinations(i32([-1, 3, 24, -5]))
    assert rows.dtype == torch.int64 and rows.tolist() == [24, 3, 24, 24]
    with pytest.raises(tpool.InvalidPage):
        c.check()


@pytest.mark.parametrize("arg", range(5))
def test_a_zero_size_is_refused(arg):
    sizes = [1, 4, 2, 1, 1]  # num_pages, page_size, layers, heads, head_dim
    sizes[arg] = 0
    with pytest.raises(ValueError, match="expected a positive int, got 0"):
        PagedKVCache(*sizes, dtype=torch.float32, device="cpu")


def test_write_rows_refuses_rows_that_are_not_int64():
    c = _cache(layers=1, heads=1, dim=1)
    x = torch.ones(2, 1, 1)
    with pytest.raises(ValueError, match="rows: expected a 1-D int64 tensor"):
        c._write_rows(0, i32([0, 1]), x, x)
    c._write_rows(0, c.destinations(i32([0, 1])), x, x)
    assert c.k[0].flatten()[:2].tolist() == [1.0, 1.0]


def test_chunk_tokens_counts_the_scores_when_query_heads_outnumber_kv_elements():
    """With 64 query heads over one K/V head of 1 element, the scores ([C, Hkv, Hq // Hkv, span + 1], 4352
    bytes a token over a span of 16, three at once with a softcap or sinks) outweigh the keys (64 bytes):
    3 * 4352 + 24 * 16 (masks, page ids) = 13,440 bytes a token, 4 tokens in 4 of those, not 840."""
    assert attention.chunk_tokens(100, 16, 1, 1, 64, chunk_bytes=4 * 13440) == 4
    assert attention.chunk_tokens(100, 16, 1, 1, 64, chunk_bytes=4 * 13440 - 1) == 3


def test_chunk_tokens_counts_each_tokens_output_beside_its_keys_and_scores():
    """A mutation test (helper-196): the einsum's output (``[C, Hq, D]`` float32, 64 bytes a token here) could
    be dropped from a token's bytes with no test failing. Span 16, 2 K/V heads of 4, 4 query heads: keys 512
    bytes (twice: einsum's copy), scores 4 * 17 * 4 = 272, output 64, masks and page ids 24 * 16 = 384:
    1,744 bytes a token, so 3 tokens in 3 of those and 2 in a byte less (3 with 1,680, the output left out)."""
    assert attention.chunk_tokens(100, 16, 2, 4, 4, chunk_bytes=3 * 1744) == 3
    assert attention.chunk_tokens(100, 16, 2, 4, 4, chunk_bytes=3 * 1744 - 1) == 2
