"""Benchmark: the working tree against a git revision, both loaded in one process, samples interleaved.

On a shared machine two runs of a benchmark a minute apart can differ by more than a
change is worth (this project's hosts moved by 25-50%). Here both versions of tpool run
in the same process: the revision is extracted (``git archive``) as a package named
``tpool_base`` (its imports of ``tpool`` rewritten) into a folder per commit under
``$TPOOL_AB_CACHE`` (default ``~/.cache/tpool-ab``), kept, so its numba kernels compiled
once are cached beside it for the next comparison with that commit (a first run of a
commit compiles them: ~25 s on 2 cores), each
version builds its own pool and table for the workloads of ``bench_page_table.py``, and
the two take turns, sample by sample, in a shuffled order each round. The machine's
noise then falls on both alike. Printed per row: each version's median, p20 and p80, the
ratio of the medians (working tree over revision: below 1, the working tree is faster;
the other benchmark scripts print baseline over row, where above 1 is faster),
and in how many paired samples the working tree was faster.

An A/A run (``--base HEAD`` on a clean tree) shows the harness's own bias: the two
tables sit at different places in memory, which can move a row by a few percent either
way. Trust a ratio outside that band, with a lopsided paired count.

    python benchmarks/ab_compare.py "tpool-numba turnover, bound" "tpool-numba step"          # warm, HEAD as base
    python benchmarks/ab_compare.py "tpool-numba turnover, bound" --cold --base HEAD~3 --samples 60
"""

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, CacheFlusher, HelpFormatter, calibrate, check_backends, int_at_most,  # noqa: E402
                     positive_int, print_table, progress, quantiles, time_calls_us)

import torch  # noqa: E402

import bench_page_table as bpt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_NAME = "tpool_base"
EXTRACT_VERSION = 1  # part of the cache folder's name: change it when extract_base changes what it writes


def extract_base(rev: str, into: str) -> None:
    """``tpool`` and ``kernels`` at ``rev`` as the package ``into/tpool_base`` (kernels inside, as
    installed), every import of ``tpool`` in it rewritten to ``tpool_base``."""
    archive = os.path.join(into, "base.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "-o", archive, rev, "tpool", "kernels"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    os.remove(archive)
    pkg = os.path.join(into, BASE_NAME)
    os.rename(os.path.join(into, "tpool"), pkg)
    os.rename(os.path.join(into, "kernels"), os.path.join(pkg, "kernels"))  # installed as tpool.kernels
    pattern = re.compile(r"\b(from|import) tpool\b|\btpool\.kernels\b|\"tpool\.")
    for folder, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                text = pattern.sub(lambda m: m.group(0).replace("tpool", BASE_NAME), text)
                with open(path, "w") as f:
                    f.write(text)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter,
                                 epilog="Rows are bench_page_table.py's names, e.g. \"tpool-numba step\", "
                                        "\"tpool-numba turnover, bound\", \"tpool-numba turnover, one call\". The base "
                                        "revision is extracted (and its numba kernels cached) under $TPOOL_AB_CACHE, "
                                        "default ~/.cache/tpool-ab.")
    ap.add_argument("rows", nargs="+", action=Distinct, help="bench_page_table.py rows to compare")
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--batch", type=positive_int, default=256, help="requests in the batch")
    ap.add_argument("--backend", default="numba", help="tpool backend (on the CPU)")
    ap.add_argument("--samples", type=positive_int, default=40, help="samples per row and version")
    ap.add_argument("--inner", type=int_at_most(bpt.MAX_INNER, "each call adds a token to every request"),
                    default=None, help=f"calls per warm sample, at most {bpt.MAX_INNER} as in bench_page_table.py "
                                       "(default: calibrated to about 2 ms); cold: calls per sample")
    ap.add_argument("--cold", action="store_true", help="time one call after 64 MiB written, --inner (default 10) "
                                                        "calls a sample")
    ap.add_argument("--seed", type=int, default=0, help="the order the versions take in each round")
    return ap


def time_sample(fn, reset, inner, flush):
    """One sample: ``reset``, one untimed call, then ``inner`` calls (each after ``flush`` when cold)."""
    reset()
    fn()
    if flush is None:
        return time_calls_us(fn, inner) / inner
    total = 0.0
    for _ in range(inner):
        flush()
        total += time_calls_us(fn, 1)
        fn()  # the next timed call follows a step, as in a decode loop
    return total / inner


def base_tree(rev: str) -> str:
    """The folder holding ``rev`` as ``tpool_base``: extracted once per commit and kept (its compiled
    kernels are cached there), under ``$TPOOL_AB_CACHE`` or ``~/.cache/tpool-ab``."""
    found = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:  # before anything is extracted or compiled, as for an unknown row
        raise SystemExit(f"--base: {rev!r} is not a commit of {ROOT} (a branch, tag or hash git knows there)")
    sha = found.stdout.strip()
    root = os.environ.get("TPOOL_AB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tpool-ab")
    path = os.path.join(root, f"{sha}-{EXTRACT_VERSION}")
    if os.path.isdir(os.path.join(path, BASE_NAME)):
        progress(f"{rev} ({sha[:12]}) already extracted in {path}")
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="extracting-", dir=root)
    progress(f"extracting {rev} ({sha[:12]}) into {path}")
    try:
        extract_base(sha, tmp)
        os.replace(tmp, path)  # whole or not at all: another run may be extracting the same commit
    except OSError:
        if not os.path.isdir(os.path.join(path, BASE_NAME)):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    check_backends(ap, "--backend", [args.backend], "cpu")
    known = bpt.row_names([args.backend])
    unknown = [row for row in args.rows if row not in known]
    if unknown:  # before anything compiles
        raise SystemExit(f"unknown row(s) {', '.join(map(repr, unknown))}; rows:\n  " + "\n  ".join(known))
    return compare(args, base_tree(args.base))


def compare(args, into):
    """Build both versions' workloads (the revision's from ``into``), time them in turns, print the table."""
    sys.path.insert(0, into)
    new, base = __import__("tpool"), __import__(BASE_NAME)  # the working tree's, the revision's
    runs = {}
    for label, mod in (("base", base), ("new", new)):
        progress(f"{label}: setting up B={args.batch}")
        bpt.tpool = mod  # the workloads build their pools and tables from this module
        impls = bpt.workloads(args.batch, [args.backend], torch.device("cpu"))  # every row row_names() allows
        for row in args.rows:
            if row not in impls:  # a row this device or backend does not make
                raise SystemExit(f"row {row!r} is not made here; rows:\n  " + "\n  ".join(impls))
            fn, owner, _ = impls[row]
            runs[(row, label)] = (fn, bpt.make_reset(fn, owner))
    bpt.tpool = new
    flush = CacheFlusher() if args.cold else None
    inner = {}  # calls per sample, one count per row for both versions: paired samples do the same work
    for row in args.rows:
        counts = [calibrate(fn, reset=reset, max_inner=bpt.WARM_INNER)  # (also each version's warm-up)
                  for fn, reset in (runs[(row, "base")], runs[(row, "new")])]
        inner[(row, "base")] = inner[(row, "new")] = (args.inner or 10) if args.cold else (args.inner or counts[0])
    keys, rng = list(runs), random.Random(args.seed)
    out = {k: [] for k in keys}
    for s in range(args.samples):
        rng.shuffle(keys)
        for k in keys:
            out[k].append(time_sample(*runs[k], inner[k], flush))
        if (s + 1) % 10 == 0:
            progress(f"sample {s + 1}/{args.samples}")
    rows = []
    for row in args.rows:
        b, n = out[(row, "base")], out[(row, "new")]
        qb, qn = quantiles(b), quantiles(n)
        wins = sum(x < y for x, y in zip(n, b))
        rows.append([row, f"{qb[0]:.2f}", f"{qb[1]:.2f} / {qb[2]:.2f}", f"{qn[0]:.2f}", f"{qn[1]:.2f} / {qn[2]:.2f}",
                     f"{qn[0] / qb[0]:.3f}", f"{wins}/{len(n)}"])
    print_table(f"working tree against {args.base}, B={args.batch}, {args.backend}, "
                f"{'cold (64 MiB written before each call)' if args.cold else 'warm'} (us per call)",
                ["row", "base median", "base p20 / p80", "new median", "new p20 / p80", "new / base",
                 "new faster (paired)"], rows)


if __name__ == "__main__":
    main()
