"""A 500-page PDF is iterated with bounded memory: peak RSS growth is asserted (in a fresh process), not time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pymupdf

REPO = Path(__file__).resolve().parents[2]

# Runs in a child so that ru_maxrss (a high-water mark) belongs to this iteration alone.
CHILD = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[2])
from vision import open_media, RenderOptions

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

doc = open_media(sys.argv[1], options=RenderOptions(pdf_dpi=100))
pages = doc.pages()
first = next(pages)                       # warm up: fonts, caches, first page buffers
size = first.image.size
texts = int(bool(first.text.strip()))
del first
before = peak_mib()
count = 1
for page in pages:                        # the caller keeps nothing, as the pipeline does
    assert page.ok, page.error
    texts += bool(page.text.strip())
    count += 1
doc.close()
print(json.dumps({"before": before, "after": peak_mib(), "count": count, "texts": texts, "size": size}))
"""


def test_500_page_pdf_iterates_in_bounded_memory(tmp_path):
    doc = pymupdf.open()
    for number in range(500):
        page = doc.new_page(width=595, height=842)
        page.insert_text((72, 72), f"Page {number + 1} of the long report", fontsize=14)
        page.draw_rect(pymupdf.Rect(72, 100, 523, 770), color=(0, 0, 0), fill=(0.9, 0.9, 0.9))
    path = tmp_path / "long.pdf"
    doc.save(path)
    doc.close()

    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(REPO)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["count"] == 500 and r["texts"] == 500
    page_mib = r["size"][0] * r["size"][1] * 3 / 2**20  # one RGB page: ~2.7 MiB at 100 dpi
    all_pages_mib = 500 * page_mib  # ~1.3 GiB if pages were kept
    growth = r["after"] - r["before"]
    # A few pages' worth (pixmap + PIL copy + MuPDF caches) is fine; anything proportional to the page count is not.
    print(f"peak RSS growth over 499 pages: {growth:.1f} MiB (one page {page_mib:.1f} MiB, "
          f"all {all_pages_mib:.0f} MiB)")
    assert growth < 20 * page_mib, (growth, page_mib, all_pages_mib)
