"""Arena: first-fit, alignment, coalescing, counts (tpool.memory.arena)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpool.memory.arena import Arena, Block


def test_hand_worked_first_fit_and_fragmentation():
    arena = Arena(4096, "cpu", alignment=256)
    a, b, c = arena.alloc(100), arena.alloc(300), arena.alloc(256)
    assert [(x.offset, x.size) for x in (a, b, c)] == [(0, 256), (256, 512), (768, 256)]
    assert (arena.allocated_bytes, arena.free_bytes, arena.num_blocks) == (1024, 3072, 3)
    arena.free(b)  # free: [256, 768) and [1024, 4096)
    assert arena.free_ranges() == [(256, 512), (1024, 3072)]
    assert arena.fragmentation == pytest.approx(1 - 3072 / 3584)
    d = arena.alloc(512)  # first fit: the hole, not the tail
    assert d.offset == 256 and arena.free_ranges() == [(1024, 3072)] and arena.fragmentation == 0.0


def test_coalescing_left_right_and_both():
    arena = Arena(1024, "cpu", alignment=256)
    blocks = [arena.alloc(256) for _ in range(4)]
    assert arena.alloc(1) is None and arena.free_bytes == 0 and arena.fragmentation == 0.0
    arena.free(blocks[0])
    arena.free(blocks[2])
    assert arena.free_ranges() == [(0, 256), (512, 256)] and arena.fragmentation == 0.5
    arena.free(blocks[1])  # merges with both neighbours
    assert arena.free_ranges() == [(0, 768)]
    arena.free(blocks[3])  # merges left into the whole buffer
    assert arena.free_ranges() == [(0, 1024)] and arena.allocated_bytes == 0


@pytest.mark.parametrize("alignment", [1, 8, 64, 256, 512])
def test_alignment_of_offsets_and_sizes(alignment):
    arena = Arena(10_000, "cpu", alignment=alignment)
    for n in (1, 7, 100, 513, 3):
        b = arena.alloc(n)
        assert b.offset % alignment == 0 and b.size == -(-n // alignment) * alignment
    assert arena.allocated_bytes == sum(arena.block_size(n) for n in (1, 7, 100, 513, 3))


def test_a_capacity_between_multiples_of_the_alignment_is_rounded_up_to_whole_blocks():
    """A 1,000-byte arena of 256-byte blocks counted 1,000 bytes free, but no alloc could take the last
    232 (or a 1,000-byte request at all), and fragmentation read 0.0."""
    arena = Arena(1000, "cpu")
    assert arena.capacity_bytes == arena.free_bytes == arena.largest_free_block == 1024
    assert arena.alloc(1000).size == 1024 and arena.free_bytes == 0
    arena = Arena(1000, "cpu", alignment=16)
    b = arena.alloc(700)
    assert arena.alloc(1) is not None and arena.free_bytes == 1008 - b.size - 16
    assert arena.memory_bytes()["storage_bytes"] >= 1008


def test_bad_frees_and_arguments_raise():
    arena = Arena(1024, "cpu")
    b = arena.alloc(10)
    arena.free(b)
    with pytest.raises(ValueError, match="not a live block"):
        arena.free(b)  # double free
    again = arena.alloc(10)  # same offset and size, new serial
    assert (again.offset, again.size) == (b.offset, b.size)
    with pytest.raises(ValueError, match="not a live block"):
        arena.free(b)  # stale handle of a reused range
    with pytest.raises(ValueError, match="not a live block"):
        Arena(1024, "cpu").free(again)  # foreign handle
    with pytest.raises(ValueError, match="not a live block"):
        arena.free(Block(512, 256, 1))  # never allocated
    with pytest.raises(TypeError):
        arena.free((0, 256))
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError):
            arena.alloc(bad)
    with pytest.raises(ValueError, match="power of two"):
        Arena(1024, "cpu", alignment=3)
    with pytest.raises(ValueError, match="capacity"):
        Arena(0, "cpu")
    assert arena.num_blocks == 1


def test_typed_views_share_the_buffer():
    arena = Arena(2048, "cpu", alignment=256)
    a, b = arena.alloc(64), arena.alloc(512)
    v = arena.view(b, torch.float32, (4, 8))
    v.fill_(1.5)
    assert v.data_ptr() == arena.buffer.data_ptr() + 256
    assert torch.equal(arena.buffer[256:384].view(torch.float32), torch.full((32,), 1.5))
    w = arena.view(b, torch.int64, (2,), offset=128)
    assert w.data_ptr() == v.data_ptr() + 128
    with pytest.raises(ValueError, match="does not fit"):
        arena.view(a, torch.float64, (64,))  # 512 B in a 256 B block
    with pytest.raises(ValueError, match=rf"byte {b.offset + 2} of the arena \(the block's start {b.offset} \+ "
                                         r"offset 2\), expected a multiple of 4"):
        arena.view(b, torch.float32, (2,), offset=2)
    arena.free(a)
    with pytest.raises(ValueError, match="not a live block"):
        arena.view(a, torch.uint8, (1,))


def test_can_alloc_as_if_freed():
    arena = Arena(1024, "cpu", alignment=256)
    blocks = [arena.alloc(256) for _ in range(4)]
    assert not arena.can_alloc(512)
    assert not arena.can_alloc(512, also_free=[blocks[0], blocks[2]])  # two separate holes
    assert arena.can_alloc(512, also_free=[blocks[1], blocks[2]])
    arena.free(blocks[3])
    assert arena.can_alloc(512, also_free=[blocks[2]]) and not arena.can_alloc(512)


def _model_alloc(used, n, alignment):
    """Lowest aligned offset with n rounded-up free bytes, in a byte-per-flag model."""
    size = -(-n // alignment) * alignment
    for o in range(0, len(used) - size + 1, alignment):
        if not used[o:o + size].any():
            used[o:o + size] = True
            return o, size
    return None


def _model_free_ranges(used):
    edges = np.flatnonzero(np.diff(np.concatenate([[1], used.astype(np.int8), [1]])))
    return [(int(s), int(e - s)) for s, e in zip(edges[::2], edges[1::2])]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 16, 64]), st.integers(1, 1200),
       st.lists(st.tuples(st.booleans(), st.integers(1, 300), st.integers(0, 50)), max_size=60))
def test_random_alloc_free_match_interval_model(alignment, capacity, ops):
    arena = Arena(capacity, "cpu", alignment=alignment)
    assert arena.capacity_bytes == -(-capacity // alignment) * alignment   # whole blocks
    used = np.zeros(arena.capacity_bytes, dtype=bool)
    live = []
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            block, want = arena.alloc(n), _model_alloc(used, n, alignment)
            assert (None if block is None else (block.offset, block.size)) == want
            if block is not None:
                live.append(block)
        else:
            block = live.pop(pick % len(live))
            arena.free(block)
            used[block.offset:block.offset + block.size] = False
        ranges = _model_free_ranges(used)
        assert arena.free_ranges() == ranges
        assert (arena.allocated_bytes, arena.free_bytes) == (int(used.sum()), int((~used).sum()))
        largest = max((s for _, s in ranges), default=0)
        assert arena.fragmentation == (0.0 if not ranges else 1 - largest / int((~used).sum()))
        assert arena.num_blocks == len(live)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arena_allocates_once():
    before = torch.cuda.memory_allocated()
    arena = Arena(16 << 20, "cuda")
    assert torch.cuda.memory_allocated() - before == 16 << 20
    blocks = [arena.alloc(1 << 20) for _ in range(16)]
    arena.view(blocks[3], torch.bfloat16, (512, 1024)).fill_(2.0)
    assert torch.cuda.memory_allocated() - before == 16 << 20
    assert arena.buffer.data_ptr() % 256 == 0 and arena.device.type == "cuda"


@pytest.mark.parametrize("make, match", [
    (lambda: Arena(True, "cpu"), "capacity_bytes: expected a positive int, got True"),
    (lambda: Arena(64, "cpu", alignment=True), "alignment: expected a positive int, got True"),
    (lambda: Arena(64, "cpu", alignment=0), "alignment: expected a positive int, got 0"),
    (lambda: Arena(64, "cpu", alignment=48), "alignment: expected a power of two, got 48"),
    (lambda: Arena(64, "meta"), "device: expected a cpu or cuda device, got meta"),
    (lambda: Arena(64, "bogus"), "device: expected a cpu or cuda device"),
])
def test_bad_constructor_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_sizes_must_be_ints_not_bools():
    assert Arena(np.int64(512), "cpu", alignment=np.int32(64)).capacity_bytes == 512  # numpy ints are sizes
    arena = Arena(1024, "cpu")
    b = arena.alloc(64)
    for call, match in [
        (lambda: arena.alloc(True), "nbytes: expected a positive int, got True"),
        (lambda: arena.block_size(False), "nbytes: expected a positive int, got False"),
        (lambda: arena.view(b, torch.float32, (-2, -2)), r"shape\[0\]: expected a non-negative int, got -2"),
        (lambda: arena.view(b, torch.float32, (2, True)), r"shape\[1\]: expected a non-negative int, got True"),
        (lambda: arena.view(b, "float32", (2,)), "dtype: expected a torch.dtype, got str"),
        (lambda: arena.view(b, torch.float32, (2,), offset=-4), "offset: expected a non-negative int, got -4"),
        (lambda: arena.bytes_of(b, True), "nbytes: expected a non-negative int, got True"),
        (lambda: arena.bytes_of(b, 8, offset=-4), "offset: expected a non-negative int, got -4"),
        (lambda: arena.bytes_of(b, offset=300), r"offset: expected at most 256 \(the block's size\), got 300"),
        (lambda: arena.bytes_of(b, 300), r"range \[0, 300\) does not fit in a block of 256 bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(TypeError, match="expected an arena Block, got str"):
        arena.view("notablock", torch.float32, (2,))  # the block is checked first
    assert arena.num_blocks == 1 and arena.view(b, torch.float32, (0, 4)).shape == (0, 4)
    # an empty range at the block's end fits (offset == size), one byte past it does not
    assert b.size == 256 and arena.bytes_of(b, offset=256).numel() == 0
    assert arena.view(b, torch.float32, 0, offset=256).numel() == 0
    with pytest.raises(ValueError, match=r"offset: expected at most 256 \(the block's size\), got 257"):
        arena.bytes_of(b, 0, offset=257)


def test_view_takes_an_int_shape_as_torch_does_and_names_a_bad_shape():
    arena = Arena(1024, "cpu")
    b = arena.alloc(64)
    assert arena.view(b, torch.float32, 4).shape == (4,) == arena.view(b, torch.float32, np.int64(4)).shape
    assert arena.view(b, torch.float32, 4).data_ptr() == arena.view(b, torch.float32, (4,)).data_ptr()
    assert arena.view(b, torch.float32, torch.Size([2, 8])).shape == (2, 8)
    for bad, name in [(None, "NoneType None"), (4.0, "float 4.0"), ("ab", "str 'ab'")]:
        with pytest.raises(ValueError, match=f"shape: expected an int or a sequence of ints, got {name}"):
            arena.view(b, torch.float32, bad)
    with pytest.raises(ValueError, match=r"shape\[0\]: expected a non-negative int, got True"):
        arena.view(b, torch.float32, True)
    with pytest.raises(ValueError, match="does not fit"):
        arena.view(b, torch.float32, 65)  # 260 B in a 256 B block


@pytest.mark.parametrize("alignment", [256, 4096, 1 << 16])
def test_block_addresses_are_multiples_of_the_alignment(alignment):
    """Block offsets are multiples of the alignment, and so are their addresses (O_DIRECT wants page-
    aligned buffers): the buffer itself starts aligned, whatever the allocator returned."""
    keep = []
    for i in range(8):
        keep.append(torch.empty(8 * i + 8, dtype=torch.uint8))  # move the heap's next address
        arena = Arena(3 * alignment, "cpu", alignment=alignment)
        assert arena.buffer.numel() == 3 * alignment and arena.buffer.data_ptr() % alignment == 0
        blocks = [arena.alloc(1), arena.alloc(alignment + 1)]
        assert all(arena.bytes_of(b, 1).data_ptr() % alignment == 0 for b in blocks)
        keep.append(arena)


def test_memory_bytes_counts_the_whole_buffer_and_its_blocks():
    arena = Arena(4096, "cpu", alignment=256)
    a, _ = arena.alloc(100), arena.alloc(300)             # sizes 256 and 512
    assert arena.memory_bytes() == {"storage_bytes": arena.buffer.untyped_storage().nbytes(), "capacity_bytes": 4096,
                                    "allocated_bytes": 768, "free_bytes": 3328, "blocks": 2}
    assert 4096 <= arena.memory_bytes()["storage_bytes"] <= 4096 + 255  # cut from up to alignment - 1 more
    arena.free(a)
    assert arena.memory_bytes()["allocated_bytes"] == 512 and arena.memory_bytes()["free_bytes"] == 3584


def test_can_alloc_refuses_a_stale_foreign_or_repeated_block_in_also_free():
    """A stale or foreign block counted as free, and a block listed twice restarted the merge of the free
    ranges: ``can_alloc(768, also_free=[b1, b1])`` said no where ``[b1]`` says yes."""
    arena = Arena(1024, "cpu", alignment=256)
    b0, b1, b2, b3 = [arena.alloc(256) for _ in range(4)]
    arena.free(b0)
    arena.free(b2)
    assert arena.can_alloc(768, also_free=[b1])
    with pytest.raises(ValueError, match="offset 256 is listed twice"):
        arena.can_alloc(768, also_free=[b1, b1])
    with pytest.raises(ValueError, match="not a live block"):
        arena.can_alloc(256, also_free=[b0])  # freed: stale
    with pytest.raises(ValueError, match="not a live block"):
        arena.can_alloc(256, also_free=[Arena(1024, "cpu").alloc(256)])
    with pytest.raises(TypeError, match="expected an arena Block"):
        arena.can_alloc(256, also_free=[(0, 256)])


def test_view_checks_the_address_alignment_not_the_offset_in_the_block():
    """A float64 view at byte 4 of the arena (offset 0 of a block starting at 4) is misaligned."""
    arena = Arena(64, "cpu", alignment=4)
    arena.alloc(4)
    block = arena.alloc(12)
    assert block.offset == 4
    with pytest.raises(ValueError, match="expected a multiple of 8"):
        arena.view(block, torch.float64, 1)
    assert arena.view(block, torch.float64, 1, offset=4).shape == (1,)  # byte 8 of the arena


def test_memory_bytes_counts_the_storage_of_a_buffer_cut_to_align_it():
    """``storage_bytes`` is the storage's size, ``alignment - 1`` more than the capacity when the buffer
    was cut from a larger one (an allocation the allocator did not align to 64 KiB)."""
    keep = []
    for _ in range(8):
        arena = Arena(1 << 16, "cpu", alignment=1 << 16)
        keep.append(arena)
        if arena.buffer.untyped_storage().nbytes() != arena.capacity_bytes:
            break
    else:
        pytest.skip("every buffer came 64 KiB-aligned: none was cut")
    assert arena.memory_bytes()["storage_bytes"] == (1 << 16) + (1 << 16) - 1
    assert arena.memory_bytes()["capacity_bytes"] == 1 << 16


def test_an_arena_made_under_inference_mode_is_written_outside_it():
    # An engine's set-up often runs under torch.inference_mode(): the buffer was an inference tensor then, and
    # bytes_of(block), the documented place to copy into, refused any in-place write outside the mode.
    with torch.inference_mode():
        arena = Arena(4096, "cpu")
    assert not arena.buffer.is_inference()
    block = arena.alloc(64)
    arena.bytes_of(block).fill_(7)
    assert arena.view(block, torch.uint8, 64).tolist() == [7] * 64
