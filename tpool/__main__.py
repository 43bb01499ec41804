"""Command line: ``python -m tpool demo`` and ``python -m tpool report``."""

import sys

USAGE = """usage: python -m tpool COMMAND [options]

commands:
  demo     run the demo (batched alloc/free on a pool, with a table);
           with --model llama|gpt-neox: serve a tiny transformers model on tpool pages (needs tpool[hf])
  report   print the memory report: references, caching allocator, driver (--json)
"""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo" and any(a == "--model" or a.startswith("--model=") for a in rest):
        from tpool.serving.engine import main as serve_main
        return serve_main(rest) or 0
    if cmd == "demo":
        from tpool import demo
        demo.main(rest)
        return 0
    if cmd == "report":
        from tpool.memory_report import main as report_main
        return report_main(rest) or 0
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
