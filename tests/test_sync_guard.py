"""The host-sync guard catches every construct it promises to, and lets fixed-shape code through."""

import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import tpool
from conftest import hot_path_calls, i32
from tpool.backends import reference
from tpool.testing import HostSyncError, _interpreter_executor, count_host_reads, no_host_sync

t = torch.arange(6)
mask = t > 2


def _patch_points():
    """Everything a guard patches, as it is now."""
    found = {f"Tensor.{n}": getattr(torch.Tensor, n) for n in ("tolist", "numpy", "cpu", "item")}
    found.update({f"torch.{n}": getattr(torch, n) for n in ("tensor", "as_tensor", "asarray")})
    found["Tensor.new_tensor"] = torch.Tensor.new_tensor
    executor = _interpreter_executor()                 # conftest loaded triton, if it is installed
    if executor is not None:
        found["GridExecutor.__call__"] = executor.__call__
    return found


ORIGINALS = _patch_points()                            # at import: no guard is active


def _still_patched():
    return [name for name, now in _patch_points().items() if now is not ORIGINALS[name]]

CONSTRUCTS = {
    "item": lambda: t[0].item(),
    "bool": lambda: bool(t[0]),
    "if on a tensor": lambda: 1 if t[1] else 0,
    "int": lambda: int(t[0]),
    "float": lambda: float(t[0]),
    "tolist": lambda: t.tolist(),
    "numpy": lambda: t.numpy(),
    "cpu": lambda: t.cpu(),
    "nonzero": lambda: torch.nonzero(t),
    "argwhere": lambda: torch.argwhere(t),
    "unique": lambda: torch.unique(t),
    "unique_consecutive": lambda: torch.unique_consecutive(t),
    "unique along a dim": lambda: torch.unique(t.view(2, 3), dim=0),
    "mask index": lambda: t[mask],
    "mask assign": lambda: t.clone().__setitem__(mask, 0),
    "uint8 mask index": lambda: t[mask.to(torch.uint8)],                 # torch's older mask dtype
    "uint8 mask assign": lambda: t.clone().__setitem__(mask.to(torch.uint8), 0),
    "masked_select": lambda: torch.masked_select(t, mask),
    "equal": lambda: torch.equal(t, t),
    "bincount": lambda: torch.bincount(t),
    "repeat_interleave": lambda: torch.repeat_interleave(t, t),
    "allclose": lambda: torch.allclose(t.float(), t.float()),
    "isin": lambda: torch.isin(t, t),
    "histc without a range": lambda: torch.histc(t.float()),
    "torch.tensor of a list of tensors": lambda: torch.tensor([t[0], t[1]]),   # read one by one in C++
    "as_tensor of nested tuples of tensors": lambda: torch.as_tensor(((t[0],), (t[1],))),
    "asarray of a list of tensors": lambda: torch.asarray([t[0], t[1]]),    # (unseen before: as torch.tensor)
    "new_tensor of a list of tensors": lambda: t.new_tensor([t[0], t[1]]),
}


@pytest.mark.parametrize("name", list(CONSTRUCTS))
def test_guard_catches(name):
    with pytest.raises(HostSyncError), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # torch: indexing with uint8 is deprecated
        with no_host_sync():
            CONSTRUCTS[name]()


def test_guard_allows_histc_with_a_range():
    """Only ``histc`` without a range reads the data's min and max; given one (positionally or by
    keyword, one bound 0 or not) it runs on the device alone."""
    f = t.float()
    with no_host_sync():
        a = torch.histc(f, 4, 0, 5)
        b = torch.histc(f, bins=3, min=-2, max=0)
        c = torch.histc(f, bins=2, min=1, max=4)
    assert a.sum().item() == 6 and b.sum().item() == 1 and c.sum().item() == 4


def test_guard_allows_fixed_shape_code_and_restores_methods():
    with no_host_sync():
        x = t[t.clamp(max=3)]                      # integer-tensor indexing
        y = torch.where(mask, t, 0).cumsum(0)
        z = torch.repeat_interleave(t, t, output_size=15)
        t.clone()[torch.tensor([1])] = 3
    assert x.tolist() == [0, 1, 2, 3, 3, 3] and y[-1].item() == 12 and z.numel() == 15
    assert t.numpy().shape == (6,)                 # patched methods are back
    assert _still_patched() == []


def test_guard_sees_a_sync_inside_pool_code(monkeypatch):
    """A host read slipped into a backend would be caught (checked by planting one)."""
    pool = tpool.PagePool(8, device="cpu", backend="reference")
    into, once = reference.Pool.alloc_into, reference.Pool.alloc_once

    def leaky_into(ops, out):
        run = into(ops, out)

        def leaky(counts, *rest):
            if counts.sum() > 0:                   # a Python branch on device data
                run(counts, *rest)
        return leaky

    def leaky_once(ops, result, counts, *rest):
        if counts.sum() > 0:
            once(ops, result, counts, *rest)
    monkeypatch.setattr(reference.Pool, "alloc_into", leaky_into)
    monkeypatch.setattr(reference.Pool, "alloc_once", leaky_once)
    for out in (None, pool.alloc_out()):           # alloc without out= (alloc_once), and into out= (alloc_into)
        with pytest.raises(HostSyncError):
            with no_host_sync():
                pool.alloc(i32([1]), out=out)



def test_host_data_mode_refuses_tensors_built_from_host_values():
    with no_host_sync():
        torch.tensor([1, 2])                           # allowed by default (free on a CPU)
    for build in (lambda: torch.tensor([1, 2]), lambda: torch.as_tensor(3), lambda: torch.asarray([1, 2]),
                  lambda: t.new_tensor([1, 2]), lambda: t.new_tensor(3)):   # (the last three unseen before)
        with pytest.raises(HostSyncError, match="host data"):
            with no_host_sync(host_data=True):
                build()
    with no_host_sync(host_data=True):
        torch.full((3,), 5)                            # a fill on the device: no host data
        torch.as_tensor(t)                             # a tensor already: no copy
        torch.asarray(t)
        t.clone()[1:3] = 7                             # a slice set: a fill_ taking the number as an argument
        t.clone()[0] = 7                               # one element: on a device the scalar is made there
        #                                                (at::scalar_tensor; tests/meta_device.py shows it)


def test_hot_paths_build_no_tensor_from_host_data(backend):
    """On CUDA a tensor made from a Python value is a pageable copy that syncs; no hot path makes one
    (the first call of a shape makes its buffers: the sequence runs once unguarded first). The same
    sequence runs under ``set_sync_debug_mode("error")`` on a GPU (``tests/test_graphs.py``)."""
    run, pool, table = hot_path_calls(backend)
    run()
    with no_host_sync(host_data=True):
        run()
    pool.check()
    table.check_invariants()
    assert pool.stats()["pages.revived"] == 4      # two revives a run, each of a CACHED page


def _in_threads(*targets):
    """Run each target in a thread of its own, in step through ``steps`` (a barrier they share);
    re-raise the first failure. A failing thread breaks the barrier so the others stop too."""
    steps = threading.Barrier(len(targets), timeout=30)
    errors = []

    def run(target):
        try:
            target(steps)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)
            steps.abort()
    threads = [threading.Thread(target=run, args=(target,)) for target in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))   # the cause first
    if errors:
        raise errors[0]


def test_guards_leaving_out_of_order_in_two_threads_put_back_the_originals():
    """A enters, B enters, A leaves, B leaves: B's guard holds until B leaves, and then every
    patched function is the one there was before any guard."""
    def a(steps):
        with no_host_sync():
            steps.wait()                               # 1: A is in
            steps.wait()                               # 2: B is in
        steps.wait()                                   # 3: A is out

    def b(steps):
        steps.wait()
        with no_host_sync(host_data=True):
            steps.wait()
            steps.wait()
            with pytest.raises(HostSyncError):
                t.tolist()                             # B's guard outlives A's
            with pytest.raises(HostSyncError):
                torch.tensor([1, 2])
    _in_threads(a, b)
    assert _still_patched() == []
    assert "tolist" not in vars(torch.Tensor)          # inherited again, not a copy set on the class


def test_a_thread_without_a_guard_reads_freely_while_another_holds_one():
    def guarded(steps):
        with no_host_sync(host_data=True):
            steps.wait()                               # 1: the guard is on
            steps.wait()                               # 2: the other thread has read
            with pytest.raises(HostSyncError):
                t.tolist()
            with pytest.raises(HostSyncError):
                t[1].item()

    def free(steps):
        steps.wait()
        assert t.tolist() == [0, 1, 2, 3, 4, 5] and t[1].item() == 1 and bool(t[1])
        assert t.numpy().sum() == 15 and t.cpu() is t and torch.unique(t[mask]).tolist() == [3, 4, 5]
        assert torch.tensor([1, 2]).tolist() == [1, 2] and torch.as_tensor(3).item() == 3
        steps.wait()
    _in_threads(guarded, free)


def test_counting_in_one_thread_while_another_raises():
    """Each thread's reads go to its own guard: B counts B's reads only, A's still raise."""
    seen = []

    def raising(steps):
        with no_host_sync():
            steps.wait()                               # 1: A's guard is on
            steps.wait()                               # 2: B's is on
            with pytest.raises(HostSyncError):
                t.tolist()
            with pytest.raises(HostSyncError):
                bool(t[1])
            steps.wait()                               # 3: A has tried, B reads now
            steps.wait()                               # 4: B is out

    def counting(steps):
        steps.wait()
        with count_host_reads() as reads:
            steps.wait()
            steps.wait()
            t.tolist()
            t[1].item()
            torch.unique(t)
        seen.extend(reads.reads)
        steps.wait()
    _in_threads(raising, counting)
    assert [what.split(" (")[0] for what, _ in seen] == ["Tensor.tolist()", "Tensor.item()", "unique"]
    assert all(stack[0][1] == "counting" for _, stack in seen)


def test_nested_guards_the_innermost_decides():
    with no_host_sync():
        with count_host_reads() as seen:
            t.tolist()
            t[0].item()
            torch.unique(t)                            # a dispatched op: counted once, not raised by the outer
            bool(t[1])
        with pytest.raises(HostSyncError):
            t.tolist()                                 # the outer guard decides again
    assert [what.split(" (")[0] for what, _ in seen.reads] == \
        ["Tensor.tolist()", "Tensor.item()", "unique", "a scalar read"]
    with count_host_reads() as seen:
        for read in (t.tolist, lambda: torch.unique(t), lambda: t[mask]):
            with pytest.raises(HostSyncError):
                with no_host_sync():
                    read()
        t.numpy()
    assert [what for what, _ in seen.reads] == ["Tensor.numpy()"]   # the raised reads are not counted
    assert _still_patched() == []


def test_count_host_reads_counts_tensors_built_from_host_data():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch.tensor(a tensor) suggests clone().detach()
        with count_host_reads(host_data=True) as seen:
            torch.tensor([1, 2])
            torch.as_tensor(3)
            torch.tensor(t)                            # a tensor already: no copy from the host
            torch.as_tensor(t)
        with count_host_reads() as plain:
            torch.tensor([1, 2])                       # host_data off: not a read
        with no_host_sync(host_data=True):
            with count_host_reads() as inner:
                torch.tensor([1, 2])                   # the innermost guard has host_data off
    assert [what.split()[0] for what, _ in seen.reads] == ["torch.tensor()", "torch.as_tensor()"]
    assert plain.reads == [] and inner.reads == []


META_PARTS = Path(__file__).parent / "_meta_hot_paths.py"


def _meta(part):
    p = subprocess.run([sys.executable, str(META_PARTS), part], capture_output=True, text=True, timeout=600,
                       cwd=META_PARTS.parent)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout.splitlines()


def test_the_meta_device_refuses_every_read_of_data_and_records_blocking_copies():
    """tests/meta_device.py, shown able to fail: on the meta device a tensor holds no data, so every read
    of it fails, also those the dispatch guard cannot see (.to("cpu"), a copy_ into host memory); a
    host-to-device copy from pageable memory is recorded, a pinned non_blocking one not; a tensor built from
    host values with device= (no dispatch: the watch cannot see it) is refused by no_host_sync(host_data=True),
    which every part runs under too."""
    assert _meta("plants") == ["tolist refused", "to cpu refused", "item refused", "copy out refused",
                               "tensor(list, device=) refused", "events:",
                               "  a host-to-device copy (non_blocking=False, pinned=False) at "]


@pytest.mark.parametrize("part", ["pool-and-table", "mirror"])
def test_hot_paths_on_the_meta_device_read_no_data_and_make_no_blocking_copy(part):
    """The CUDA side of every branch, on a CPU: the reference backend on the meta device (tpool branches on
    device.type == "cpu"), where any read of device data raises whatever path it takes, and a copy a CUDA
    stream would wait for is recorded. pool-and-table: conftest.hot_path_calls and the forms it leaves out
    (step with release= and release_cache=, out=, bound with out=, a free group, generations(out=), alloc
    without out=, a CSR with capacity=, the start of stats_async); mirror: every HostMirror call (revive
    direct, the start of a snapshot) and the PrefixCache's insert/match/revive/evict/unread/drop."""
    assert _meta(part) == ["events:"]


def test_a_read_names_the_callers_frames_whatever_their_files_are_called(tmp_path):
    """A read's stack leaves out torch's and tpool.testing's own frames only. Before, it left out every
    file whose name ended in "testing.py" and every path holding "/torch/": an engine's
    ``engine_testing.py``, kept in a folder called ``torch``, vanished from the stack."""
    import importlib.util
    folder = tmp_path / "torch"
    folder.mkdir()
    (folder / "engine_testing.py").write_text("def read_it(t):\n    return t.tolist()\n")
    spec = importlib.util.spec_from_file_location("engine_testing", folder / "engine_testing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with count_host_reads() as seen:
        module.read_it(t)
    ((what, stack),) = seen.reads
    assert what == "Tensor.tolist()"
    assert stack[:2] == [(str(folder / "engine_testing.py"), "read_it"),
                         (__file__, "test_a_read_names_the_callers_frames_whatever_their_files_are_called")]


def test_a_grid_read_from_device_data_is_seen_inside_an_interpreted_launch():
    """A callable grid runs on the host before a GPU launch: one that reads device data is a sync. Under
    the interpreter the guard is suspended inside the launch, and the grid is evaluated there: before,
    ``kernel[lambda meta: (int(n),)]`` passed no_host_sync(). A grid of static values and the kernel's
    own arguments still passes, and the launch's own copies are still not reads."""
    if _interpreter_executor() is None:
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x, n = torch.zeros(8, dtype=torch.int32), torch.tensor(2)
    with no_host_sync():
        add_one[(2,)](x, 8, BLOCK=4)
        add_one[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, 8, BLOCK=4)
    assert x.tolist() == [2] * 8
    with pytest.raises(HostSyncError, match="scalar read"):
        with no_host_sync():
            add_one[lambda meta: (int(n),)](x, 8, BLOCK=4)
    with count_host_reads() as seen:
        add_one[lambda meta: (n.item(),)](x, 8, BLOCK=4)
    assert [what for what, _ in seen.reads] == ["Tensor.item()"] and x.tolist() == [3] * 8
    assert _still_patched() == []


def test_builders_take_their_data_by_keyword_under_a_guard():
    """The patched builders pass every argument on as given: ``torch.asarray(obj=...)`` (its parameter's
    name) raised TypeError under a guard, the wrapper wanting ``data`` first. By keyword the data is
    still seen, and a call with no data gets the builder's own error."""
    with no_host_sync():
        got = [torch.asarray(obj=[1, 2]), torch.tensor(data=[1, 2]), torch.as_tensor(data=[1, 2]),
               t.new_tensor(data=[1, 2])]
    assert all(g.tolist() == [1, 2] for g in got)
    for build in (lambda: torch.asarray(obj=[t[0]]), lambda: torch.tensor(data=[t[0]]),
                  lambda: t.new_tensor(data=[t[0]])):
        with pytest.raises(HostSyncError, match="holding tensors"):
            with no_host_sync():
                build()
    with pytest.raises(HostSyncError, match="host data"):
        with no_host_sync(host_data=True):
            torch.asarray(obj=[1, 2])
    with pytest.raises(TypeError):
        with no_host_sync(host_data=True):
            torch.tensor()


def test_a_launcher_without_a_grid_attribute_launches_as_before():
    """The interpreted launch's wrapper reads ``grid`` (triton 3.x's attribute) only if it is there: a
    launcher that names it otherwise is called as it is, inside the suspended region."""
    from tpool.testing import _device_region

    class Launcher:
        def __call__(self, x):
            return x.tolist()                          # the simulated device's copy: not a host read

    launch = _device_region("__call__", Launcher.__call__)
    with no_host_sync():
        assert launch(Launcher(), t) == list(range(6))
