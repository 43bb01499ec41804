"""Compile recorded Triton launches for sm_90 without a GPU (run by test_triton_compile.py).

Usage: python _compile_kernels.py LAUNCHES.json. Run without TRITON_INTERPRET, so that
``@triton.jit`` gives compilable kernels. Prints one line per launch; exit status 1 if
any fails to compile.
"""

import importlib
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def main(path):
    failed = 0
    for rec in json.load(open(path)):
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        try:
            src = ASTSource(fn=fn, signature=rec["signature"], constexprs=rec["constexprs"])
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=rec["num_warps"]))
            print("compiled", rec["name"], rec["constexprs"])
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print("FAILED", rec["name"], rec["constexprs"], (str(e).strip().splitlines() or [repr(e)])[-1])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
