"""The command's name as the user typed it, for usage lines: ``tpool`` (the installed script) or ``python -m tpool``."""

import os
import sys


def prog(command: str = "") -> str:
    """``"tpool demo"`` when run as the installed ``tpool`` script, else ``"python -m tpool demo"``."""
    name = os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "")
    base = "tpool" if name in ("tpool", "tpool.exe") else "python -m tpool"
    return f"{base} {command}".strip()
