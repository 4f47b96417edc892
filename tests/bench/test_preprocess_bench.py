"""bench/preprocess_bench.py on the CPU: one quick run writes every input's stages, memory, thread rows and GIL
references, with the sizes the product's inputs have."""
from __future__ import annotations

import json
from pathlib import Path

import preprocess_bench as bench
import pytest


def test_a_quick_run_reports_every_stage_with_the_products_sizes(tmp_path: Path) -> None:
    out = tmp_path / "preprocess.json"
    before = tmp_path / "before.json"
    before.write_text(json.dumps({"git_commit": "older", "stages": []}))
    assert bench.main(["--repeats", "1", "--threads", "1", "2", "--thread-items", "1", "--gil-seconds", "0.05",
                       "--out", str(out), "--before", str(before)]) == 0
    result = json.loads(out.read_text())
    stages = {(r["input"], r["stage"]): r for r in result["stages"]}
    for kind in ("page", "photo", "video (per frame group)"):
        assert stages[(kind, "total")]["cpu_ms"] > 0
        assert stages[(kind, "normalise+patchify")]["out_bytes"] > 0
    # A4 at 150 dpi -> 1248x1760: 8580 patches of 3*2*16*16 float32; the photo (EXIF 6) -> 1536x2048
    assert stages[("page", "normalise+patchify")]["out_bytes"] == 8580 * 1536 * 4
    assert stages[("photo", "decode+exif")]["out_bytes"] == 2048 * 1536 * 3
    memory = {r["input"]: r for r in result["memory"]}
    assert memory["page"]["pixel_values_bytes"] == 8580 * 1536 * 4
    assert memory["page"]["numpy_peak_bytes"] >= memory["page"]["pixel_values_bytes"]
    assert [r["threads"] for r in result["threads"] if r["input"] == "video"] == [1, 2]
    assert {"ref_releases_gil", "ref_holds_gil", "page"} <= set(result["python_share"])
    assert result["before"]["git_commit"] == "older"


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--threads", "0"], ["--gil-seconds", "0"]])
def test_bad_arguments_fail(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
