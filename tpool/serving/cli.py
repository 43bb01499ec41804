"""``python -m tpool demo --model NAME``: its options, parsed before transformers is imported.

The serving demo itself (:func:`tpool.serving.engine.run_demo`) needs transformers
(``tpool[hf]``); its ``--help`` and option errors do not, so a machine without it
can read what the demo takes before installing anything.
"""

import argparse

from tpool import _checks
from tpool._prog import prog
from tpool.demo import OptionError, at_most, count_int, positive_int, seed_int

MODELS = ("llama", "gpt-neox")
INSTALL_HF = "pip install 'transformers>=5' (the hf extra; pip install -e \".[hf]\" in a checkout)"
MAX_REQUESTS = 10_000    # each request is generated again by transformers to check it
MAX_PAGES = 1 << 18      # 262,144 pages, each with the K/V of every layer
MAX_BATCH = 1 << 10      # lanes of one forward
MAX_POOL_TOKENS = MAX_PAGES * 4   # num_pages x page_size: the K/V of 1,048,576 tokens (the default page size's most)


def parser() -> argparse.ArgumentParser:
    """The serving demo's command line: every option with its default."""
    ap = argparse.ArgumentParser(prog=prog("demo"), allow_abbrev=False,  # as the demo's: see wants_model
                                 description="Serve a tiny random transformers model on tpool pages and check "
                                             "every request against the model's generate (needs transformers: "
                                             f"{INSTALL_HF}).")
    ap.add_argument("--model", choices=MODELS, default="llama", help="architecture (default llama)")
    ap.add_argument("--requests", type=at_most(MAX_REQUESTS, "each is checked against generate"), default=32,
                    help=f"number of prompts, at most {MAX_REQUESTS:,} (default 32)")
    ap.add_argument("--num-pages", type=at_most(MAX_PAGES, "each page holds the K/V of every layer"), default=48,
                    help=f"pool pages, at most {MAX_PAGES:,} (default 48: fewer than the running requests "
                         "can grow to, so the loop preempts)")
    ap.add_argument("--page-size", type=positive_int, default=4,
                    help=f"tokens per page (default 4); --num-pages x --page-size at most {MAX_POOL_TOKENS:,}")
    ap.add_argument("--batch", "--max-batch", dest="max_batch", type=at_most(MAX_BATCH, "lanes of one forward"),
                    default=8, metavar="N", help=f"most requests running at once, lanes per step, at most "
                                                 f"{MAX_BATCH:,} (default 8)")
    ap.add_argument("--system-prompt", type=count_int, default=8, metavar="N",
                    help="tokens every prompt starts with, the same for all: what the prefix cache serves again "
                         "(default 8; 0: none)")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="release finished requests' pages FREE instead of keeping them CACHED for later "
                         "requests that start with the same tokens (default: keep them)")
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "numba", "triton"],
                    help="pool backend (default auto: triton on CUDA, numba on a CPU; triton on a CPU needs "
                         "TRITON_INTERPRET=1)")
    ap.add_argument("--seed", type=seed_int, default=0, help="weights and prompts seed, 0 to 2**64 - 1 (default 0)")
    ap.add_argument("--device", default=None, help="torch device of the model, the pool and the K/V pages, e.g. "
                                                   "cpu, cuda, cuda:1 (default: cuda if available, else cpu; cpu with "
                                                   "the numba backend)")
    return ap


def main(argv=None) -> int:
    """Parse the options (``--help`` needs nothing installed), then run the demo; 2 if transformers is missing."""
    ap = parser()
    a = ap.parse_args(argv)
    ap.prog = prog(f"demo --model {a.model}")  # (later errors name the model asked for, not NAME)
    if a.device is not None:
        try:
            _checks.resolve_device(a.device, "--device")  # before transformers is imported
        except ValueError as e:
            ap.error(str(e))
    try:
        from tpool.serving.engine import run_demo
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise
        ap.exit(2, f"{ap.prog}: error: serving a model needs transformers, which is not installed: {INSTALL_HF}\n")
    try:
        run_demo(a.model, requests=a.requests, num_pages=a.num_pages, page_size=a.page_size, max_batch=a.max_batch,
                 backend=a.backend, device=a.device, seed=a.seed, system_len=a.system_prompt,
                 prefix_cache=not a.no_prefix_cache)
    except OptionError as e:  # options no model, pool, table or request can be made from
        ap.error(str(e))
    return 0
