"""The commit a bench result belongs to: DOCPIPE_BENCH_COMMIT when set (device calls run from a git archive, which
has no .git), else `git rev-parse --short HEAD` of this checkout, else "unknown"."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    env = os.environ.get("DOCPIPE_BENCH_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
