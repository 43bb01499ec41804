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

Each compiled variant's PTX is also checked for what a GPU would do that the interpreter cannot show
(``HAZARDS``): the kernels' chunk loops read, after a barrier, what earlier chunks or phases of the
same program wrote, which holds only for plain coherent loads issued where the code puts them. A loop
whose loads Triton pipelines (``cp.async``: a later iteration's loads issued before this one's stores
and barriers, as ``tl.range(..., num_stages=k)`` asks for) or a load through the non-coherent
read-only path (``ld.global.nc``) would read stale values on a GPU and the right ones in the interpreter.

Prints one line per variant; exit status 1 if any fails to compile or has a hazard.
"""

import importlib
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

VARIANTS = ("recorded", "aligned", "ones")
HAZARDS = {  # PTX instruction -> why a tpool kernel must not have it
    "cp.async": "pipelined loads (a later chunk's loads issued before this chunk's stores and barriers)",
    "ld.global.nc": "a non-coherent load (may miss what the program wrote before a barrier)",
}
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


def hazards(ptx: str) -> list:
    """The ``HAZARDS`` instructions in ``ptx`` (names, sorted)."""
    return sorted(name for name in HAZARDS if re.search(r"(?<![\w.])" + re.escape(name) + r"(?![\w])", ptx))


def main(path):
    failed = 0
    for rec in json.load(open(path)):
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        for kind in VARIANTS:
            try:
                signature, constexprs, attrs = variant(fn, rec["signature"], rec["constexprs"], kind)
                src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=rec["num_warps"]))
                found = hazards(k.asm["ptx"])
                if found:
                    failed += 1
                    print("FAILED", kind, rec["name"], rec["constexprs"],
                          "; ".join(f"{name}: {HAZARDS[name]}" for name in found))
                    continue
                print("compiled", kind, rec["name"], rec["constexprs"])
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print("FAILED", kind, rec["name"], rec["constexprs"],
                      (str(e).strip().splitlines() or [repr(e)])[-1])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
