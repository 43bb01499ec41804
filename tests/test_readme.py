"""Every ```python block of README.md runs as written, on its own, and shows the values it claims.

Each block runs in a fresh namespace (nothing carried over from an earlier block).
A bare expression followed by a comment that starts with a Python literal
(``r.ok       # [True, True, False]   9 more pages ...``) is checked: its value
(tensors as lists) must equal that literal. A block containing the comment
``# needs CUDA`` is skipped without a CUDA device, and one that imports a module of an optional extra
(transformers: the hf extra) is skipped where that module is not installed, as the serving tests skip.
"""

import ast
import importlib.util
import io
import os
import re
import tokenize

import pytest
import torch

import tpool

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
NEEDS_CUDA = "# needs CUDA"
OPTIONAL = {"transformers": "the hf extra"}  # top-level modules a block may import that tpool does not require


def python_blocks(path=README):
    """(first line number, source) of each ```python block."""
    text = open(path).read()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def claimed_literal(comment: str):
    """The longest prefix of ``comment`` that is a Python literal, or raise ValueError."""
    comment = comment.strip()
    for cut in range(len(comment), 0, -1):
        try:
            return ast.literal_eval(comment[:cut].strip().rstrip(":"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    raise ValueError("no literal")


def plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value


def comments_by_line(source: str) -> dict:
    return {tok.start[0]: tok.string[1:] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def run_block(source: str) -> int:
    """Run ``source`` statement by statement; check claimed values; return how many were checked."""
    comments, namespace, checked = comments_by_line(source), {"__name__": "readme_block"}, 0
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Expr):
            value = eval(compile(ast.Expression(stmt.value), "<README>", "eval"), namespace)
            comment = comments.get(stmt.end_lineno)
            if value is None or comment is None:
                continue
            try:
                claim = claimed_literal(comment)
            except ValueError:
                continue
            assert plain(value) == claim, f"line {stmt.lineno}: {ast.unparse(stmt)} is {plain(value)!r}, " \
                                          f"the README says {claim!r}"
            checked += 1
        else:
            exec(compile(ast.Module([stmt], []), "<README>", "exec"), namespace)
    return checked


def missing_optional(source: str, optional=OPTIONAL):
    """Why ``source`` cannot run here: the first module of ``optional`` it imports that is not installed
    (None when every one is). A module outside ``optional`` never skips a block: a wrong import fails."""
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        for name in names:
            top = name.split(".")[0]
            if top in optional and importlib.util.find_spec(top) is None:
                return f"the block needs {top} ({optional[top]}), which is not installed"
    return None


BLOCKS = python_blocks()


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_readme_block_runs_on_its_own(line, source):
    if NEEDS_CUDA in source and not torch.cuda.is_available():
        pytest.skip("the block needs CUDA")
    missing = missing_optional(source)
    if missing:
        pytest.skip(missing)
    run_block(source)


def test_a_block_is_skipped_only_for_a_missing_module_of_an_optional_extra():
    """Without the hf extra the serving block was run and failed (ModuleNotFoundError), where every test
    that needs transformers skips; a missing module that no extra provides still fails the block."""
    absent = "tpool_no_such_module_"
    assert importlib.util.find_spec(absent) is None
    optional = {absent: "an extra"}
    said = f"the block needs {absent} (an extra), which is not installed"
    assert missing_optional(f"import torch\nfrom {absent}.sub import X\n", optional) == said
    assert missing_optional(f"import {absent} as t\n", optional) == said
    assert missing_optional("import torch\nimport tpool\n", optional) is None       # installed
    assert missing_optional(f"import {absent}\n", {}) is None                         # not an extra's: it fails
    with pytest.raises(ModuleNotFoundError):
        run_block(f"import {absent}\n")


def test_claimed_values_are_checked():
    """The checker itself: a right claim passes, a wrong one fails, prose is not a claim."""
    assert run_block("x = [1, 2]\nx    # [1, 2]   the list\nlen(x)  # 2: its length\nprint  # prints\n") == 2
    with pytest.raises(AssertionError, match=r"is \[1, 2\], the README says \[1, 3\]"):
        run_block("x = [1, 2]\nx    # [1, 3]\n")
    with pytest.raises(NameError):  # a block cannot lean on an earlier one
        run_block("y = undefined_in_this_block + 1\n")


def test_the_error_table_names_each_kind_and_the_class_check_raises():
    """The README's table of error kinds is the one check() uses, every kind in it."""
    from tpool.errors import ERROR_CLASSES
    from tpool.kernels import layout as L
    text = open(README).read()
    table = text[text.index("| kind, in order | raised as |"):]
    table = table[:table.index("\n\n")]
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \|$", table, re.M)
    # in the order check() picks the class in (the first kind counted, by slot)
    assert rows == [(L.ERROR_NAMES[slot], ERROR_CLASSES[slot].__name__) for slot in sorted(ERROR_CLASSES)]


def test_the_quoted_check_message_is_the_one_check_raises():
    """The README's example of what check() says after ``alloc([5000])`` on a 65,536-page pool is the
    message it raises (words and order; the quote wraps lines, and may end in "..." where it stops short)."""
    text = open(README).read()
    quote = text[text.index("    OutputOverflow: tpool: errors"):]
    quote = " ".join(quote[:quote.index("\n\n")].split())
    pool = tpool.PagePool(65536, backend="reference")
    pool.alloc(torch.tensor([5000], dtype=torch.int32))
    with pytest.raises(tpool.OutputOverflow) as e:
        pool.check()
    said = " ".join(f"{type(e.value).__name__}: {e.value}".split())
    assert said == quote or quote.endswith(" ...") and said.startswith(quote[:-len(" ...")]), (quote, said)
