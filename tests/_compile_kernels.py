"""Compile recorded Triton launches for sm_90 without a GPU (run by test_triton_compile.py).

Usage: python _compile_kernels.py LAUNCHES.json. Run without TRITON_INTERPRET, so that
``@triton.jit`` gives compilable kernels. Each launch is compiled in the variants a GPU
launch can make of it (Triton specialises on values as well as types):

* ``recorded``: the argument types as recorded, no attributes;
* ``aligned``: every pointer and every specialised int argument divisible by 16 (a tensor
  at the start of its allocation; a size such as 256), Triton's ``tt.divisibility``;
* ``ones``: every specialised int argument equal to 1, which Triton compiles as a
  constexpr (a loop that starts from such an argument and rebinds it to a block compiles
  with a 2 and fails with a 1), pointers aligned.

An int argument marked ``do_not_specialize`` keeps its recorded type in every variant.
Prints one line per variant; exit status 1 if any fails to compile.
"""

import importlib
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

VARIANTS = ("recorded", "aligned", "ones")
_DIVISIBLE = [["tt.divisibility", 16]]


def variant(fn, signature, constexprs, kind):
    """``(signature, constexprs, attrs)`` of one variant of a recorded launch of ``fn``."""
    signature, constexprs, attrs = dict(signature), dict(constexprs), {}
    if kind == "recorded":
        return signature, constexprs, attrs
    for i, (name, ty) in enumerate(list(signature.items())):
        if ty.startswith("*"):
            attrs[(i,)] = _DIVISIBLE
        elif ty in ("i32", "i64") and not fn.params[i].do_not_specialize:
            if kind == "aligned":
                attrs[(i,)] = _DIVISIBLE
            else:
                signature[name], constexprs[name] = "constexpr", 1
    return signature, constexprs, attrs


def main(path):
    failed = 0
    for rec in json.load(open(path)):
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        for kind in VARIANTS:
            try:
                signature, constexprs, attrs = variant(fn, rec["signature"], rec["constexprs"], kind)
                src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
                triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=rec["num_warps"]))
                print("compiled", kind, rec["name"], rec["constexprs"])
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print("FAILED", kind, rec["name"], rec["constexprs"],
                      (str(e).strip().splitlines() or [repr(e)])[-1])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
