"""gpu_engine/README.md's file map names every module of the package, and no module is over 500 lines."""
from __future__ import annotations

from pathlib import Path

import gpu_engine

ROOT = Path(gpu_engine.__file__).parent
MAX_LINES = 500  # STYLE.md: "500 lines is a smell"


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_is_in_the_file_map():
    text = (ROOT / "README.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in _modules()
               if p.name != "__init__.py" or p.parent == ROOT
               if f"`{p.relative_to(ROOT).as_posix()}`" not in text]
    assert missing == []


def test_every_shipped_kernel_family_is_in_the_file_map():
    text = (ROOT / "README.md").read_text()
    families = [p.stem for p in (ROOT / "cuda" / "kernels").glob("*.cu")]
    assert families and [f for f in families if f not in text] == []


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
