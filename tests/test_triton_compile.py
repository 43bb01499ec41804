"""Every Triton kernel, as launched by the library, compiles for a GPU (sm_90), even on a CPU.

The interpreter runs kernels as Python: it accepts code the compiler rejects (a
loop that rebinds a scalar to a block, for one). This test records every launch
of a workload under the interpreter (kernel, argument types, meta-parameters)
and compiles each distinct one for sm_90 in a subprocess without
TRITON_INTERPRET, in the variants Triton makes of a launch for its values (int
arguments of 1 and multiples of 16, aligned pointers). It needs no GPU; on a GPU machine the other tests compile
the kernels anyway.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import TRITON_DEVICE, i32

# A mark, not a module-level skip: under `-m gpu` (benchmarks/gpu_checks.sh, which fails on any skipped
# test) the test is deselected before its mark is read; a module-level skip counted as skipped there.
pytestmark = pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="compiles from the interpreter's launches; on a "
                                                               "GPU the tests compile every kernel")

import tpool  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_PTR = {torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8", torch.bool: "*i1"}


def _record(monkeypatch):
    launches = {}
    original = interpreter.GridExecutor.__call__

    def recording(self, *args, **kwargs):
        sig, consts = {}, {}
        for name, value in zip(self.arg_names, list(args) + [kwargs.get(n) for n in self.arg_names[len(args):]]):
            if name in self.constexprs:
                sig[name], consts[name] = "constexpr", kwargs[name]
            elif isinstance(value, torch.Tensor):
                sig[name] = _PTR[value.dtype]
            elif isinstance(value, bool):
                sig[name] = "i1"
            else:
                sig[name] = "i32" if -2**31 <= int(value) < 2**31 else "i64"
        rec = dict(module=self.fn.__module__, name=self.fn.__name__, signature=sig, constexprs=consts,
                   num_warps=kwargs.get("num_warps", 4))
        launches[json.dumps(rec, sort_keys=True)] = rec
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", recording)
    return launches


def _workload():
    """Every pool and table call, with each meta-parameter branch the library takes."""
    pool = tpool.PagePool(64, page_size=4, device="cpu", backend="triton")
    out = pool.alloc_out(max_batch=2, max_pages=8)
    pool.alloc(i32([2, 3]), out=out)
    pool.free(out.pages[:2], cache=True)
    pool.incref(out.pages[2:4])
    pool.touch(out.pages[2:4])
    pool.alloc(i32([60]), out=pool.alloc_out(max_batch=1, max_pages=64), evict=True)
    pool.free(out.pages)
    pool.evict(2)
    pool.free(out.pages)
    pool.evict(0)
    table = tpool.PageTable(tpool.PagePool(128, page_size=4, device="cpu", backend="triton"), 4, 8)
    ids = i32([0, 1, 2, -1])
    table.extend(ids, i32([5, 3, 9, 0]), max_tokens=17)    # prefill: the tile pass
    table.extend(ids, i32([1, 1, 1, 0]))                    # decode
    table.step(ids, i32([1, 1, 1, 0]))
    table.flashinfer_csr(ids)
    table.block_table_rows(ids)
    table.fork(i32([0, 2]), i32([3, -1]), i32([6, 0]))
    table.truncate(i32([2]), i32([3]))
    cached = table.block_table[0, :2].clone()
    table.release(i32([0, 3]), cache=True)
    table.revive(0, cached, 8)                              # a prefix-cache hit on row 0's pages
    table.release(i32([0]), cache=True)
    table.revive(0, cached, 8, generations=table.pool.generations(cached))  # checked against their generations
    table.release(i32([1]))
    with pool.free_group(8):
        pool.free(out.pages[:1])
    from tpool.scheduling import HostMirror, PrefixCache   # the prefix cache's own kernels
    m = HostMirror(tpool.PageTable(tpool.PagePool(32, page_size=4, device="cpu", backend="triton"), 2, 8),
                   free=32, cached=0)
    cache = PrefixCache(m)
    (row,) = m.admit([12])
    cache.insert(row, list(range(12)))
    m.finish([row], cache=True)
    m.finish([cache.revive(cache.match(list(range(13))))], cache=True)
    cache.evict(2)


def test_every_launched_kernel_compiles_for_sm90(monkeypatch, tmp_path):
    launches = _record(monkeypatch)
    _workload()
    names = {rec["name"] for rec in launches.values()}
    assert {"alloc_kernel", "free_kernel", "incref_kernel", "touch_kernel", "evict_kernel", "extend_kernel",
            "step_kernel", "flashinfer_csr_kernel", "block_table_rows_kernel", "fork_kernel",
            "release_kernel", "insert_pages_kernel", "gather_slots_kernel", "forget_pages_kernel"} <= names, names
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(list(launches.values())))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    helper = os.path.join(os.path.dirname(__file__), "_compile_kernels.py")
    proc = subprocess.run([sys.executable, helper, str(path)], capture_output=True, text=True, env=env,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("compiled") == 3 * len(launches)  # recorded, aligned, ones: see the helper


def test_the_compile_helper_compiles_the_variants_of_an_argument_of_one(tmp_path):
    """The helper's ``ones`` variant is what a GPU launch with an int argument of 1 compiles: a kernel
    calling ``.to`` on such an argument compiles as recorded and aligned, and fails there."""
    (tmp_path / "toy_kernel.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef toy(out, n):\n"
        "    tl.store(out + tl.arange(0, 4), (n.to(tl.int64) + tl.zeros((4,), dtype=tl.int64)).to(tl.int32))\n")
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([dict(module="toy_kernel", name="toy", signature={"out": "*i32", "n": "i32"},
                                     constexprs={}, num_warps=4)]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    helper = os.path.join(os.path.dirname(__file__), "_compile_kernels.py")
    proc = subprocess.run([sys.executable, helper, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [
        ["compiled", "recorded"], ["compiled", "aligned"], ["FAILED", "ones"]], proc.stdout


def test_the_compile_helper_refuses_pipelined_loads(tmp_path):
    """What the interpreter cannot show: Triton pipelines a loop's loads when asked (``tl.range(...,
    num_stages=3)``), issuing a later iteration's loads (``cp.async``) before this one's stores and barriers.
    The kernels' chunk loops read what earlier chunks wrote, so the helper fails a kernel whose PTX has
    such loads (``HAZARDS``); the same loop over a plain ``range`` compiles to ordinary loads and passes."""
    (tmp_path / "toy_pipelined.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n"
        "@triton.jit(do_not_specialize=['n'])\ndef plain(x, n, BLOCK: tl.constexpr):\n"
        "    acc = tl.zeros((BLOCK,), tl.int32)\n"
        "    for s in range(0, n, BLOCK):\n"
        "        acc += tl.load(x + s + tl.arange(0, BLOCK), mask=s + tl.arange(0, BLOCK) < n, other=0)\n"
        "    tl.store(x + tl.arange(0, BLOCK), acc)\n\n\n"
        "@triton.jit(do_not_specialize=['n'])\ndef staged(x, n, BLOCK: tl.constexpr):\n"
        "    acc = tl.zeros((BLOCK,), tl.int32)\n"
        "    for s in tl.range(0, n, BLOCK, num_stages=3):\n"
        "        acc += tl.load(x + s + tl.arange(0, BLOCK), mask=s + tl.arange(0, BLOCK) < n, other=0)\n"
        "    tl.store(x + tl.arange(0, BLOCK), acc)\n")
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([dict(module="toy_pipelined", name=name, signature={"x": "*i32", "n": "i32",
                                     "BLOCK": "constexpr"}, constexprs={"BLOCK": 256}, num_warps=2)
                                for name in ("plain", "staged")]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    helper = os.path.join(os.path.dirname(__file__), "_compile_kernels.py")
    proc = subprocess.run([sys.executable, helper, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [["compiled", kind, "plain"] for kind in ("recorded", "aligned",
                                                                                              "ones")] + [
        ["FAILED", kind, "staged"] for kind in ("recorded", "aligned", "ones")], proc.stdout
    assert all("cp.async: pipelined loads" in line for line in lines[3:]), proc.stdout


def test_row_numbers_and_page_counts_are_not_specialised():
    """Triton compiles a variant of a kernel for an int argument that is 1 or a multiple of 16 (one per
    kind, at its first launch). A row number or a page count is a value, not a shape: without
    ``do_not_specialize`` a revive into row 16, or of one page, compiled in the middle of serving."""
    code = ("from tpool.kernels import _triton_shim, prefix_cache, revive; _triton_shim.load(); "
            "print(sorted(p.name for k in (revive.revive_kernel, prefix_cache.insert_pages_kernel) "
            "for p in k.params if p.do_not_specialize))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiling JITFunction's params
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "['N', 'N', 'first', 'known', 'need', 'row', 'row']"
