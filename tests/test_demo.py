"""The README's demo command runs to the end: every request finishes, every page comes back."""

import os
import re
import subprocess
import sys


def test_demo_command_runs_to_completion():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # numba on a CPU, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "tpool", "demo"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.endswith("no errors, invariants hold"), last
    allocated, freed = map(int, re.search(r"pages allocated (\d+), freed (\d+)", last).groups())
    assert allocated == freed > 0
    assert re.search(r"^\s*\d+\s+0\s+0\s+256\s+0\s", proc.stdout, re.M), "the last row: nothing running or waiting"
