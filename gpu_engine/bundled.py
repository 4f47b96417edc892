"""The bundled tiny model: generated once (deterministically, offline) into a cache folder and reused.

Location: $DOCPIPE_CACHE_DIR/models/<name>, else ~/.cache/docpipe/models/<name>. A folder is reused only if its
SHA256SUMS still verifies; otherwise it is regenerated. Generation writes into a temporary sibling folder and
renames it into place, so concurrent first runs never see a half-written model.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .loader import SUMS_FILE, IntegrityError, read_sums_file, verify_digests
from .tiny import make_tiny_checkpoint

BUNDLED_NAME = "tiny-qwen3_5-v1"  # bump when the generator's output changes
BUNDLED_SEED = 20240601


def cache_dir() -> Path:
    env = os.environ.get("DOCPIPE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "docpipe"


def bundled_model_dir() -> Path:
    """Path of the bundled tiny checkpoint, generating it on first use."""
    target = cache_dir() / "models" / BUNDLED_NAME
    if _verified(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_NAME}-", dir=target.parent))
    try:
        make_tiny_checkpoint(staging, seed=BUNDLED_SEED)
        if target.exists():  # stale or damaged copy; another process may also be replacing it
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not _verified(target):  # lost a race to a writer whose result is not valid either
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _verified(folder: Path) -> bool:
    sums = folder / SUMS_FILE
    if not sums.is_file():
        return False
    try:
        expected = read_sums_file(sums)
        verify_digests(folder, expected, required=["config.json"])
    except IntegrityError:
        return False
    return True
