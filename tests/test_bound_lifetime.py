"""Bound calls keep what their compiled code points at alive.

A BoundStep's numba step holds raw addresses of its table's and pool's tensors;
when it was the only thing left referring to them, they were freed and the next
call wrote into freed memory (a segfault or heap corruption). Run in a
subprocess, so a regression fails this test instead of killing the test run.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, torch, tpool
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)

    def bound_step():
        pool = tpool.PagePool(4096, 16, device="cpu", backend="numba")
        table = tpool.PageTable(pool, 4, 64)
        table.extend(i32([0, 1]), i32([100, 200]), max_tokens=300)
        return table.bind_step(i32([0, 1]), i32([1, 1]))

    def alloc_out():
        return tpool.PagePool(4096, device="cpu", backend="numba").alloc_out(max_batch=1, max_pages=8)

    step, out = bound_step(), alloc_out()
    gc.collect()
    junk = [torch.full((4096,), 7, dtype=torch.int32) for _ in range(200)]  # takes any freed memory
    for _ in range(100):
        res = step()
    r = out.pool.alloc(i32([3]), out=out)
    assert all(bool((j == 7).all()) for j in junk), "a bound call wrote into memory it does not own"
    print(res.slots.tolist(), res.csr.indptr.tolist(), r.pages[:3].tolist())
""")


def test_bound_step_and_alloc_out_outlive_the_names_of_their_table_and_pool():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    # 100 decode steps after prompts of 100 and 200 tokens: lengths 200 and 300, pages 13 and 19.
    assert r.stdout.split() == ["[503,", "491]", "[0,", "13,", "32]", "[0,", "1,", "2]"]
