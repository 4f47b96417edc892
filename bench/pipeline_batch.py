"""The page batch of bench/pipeline_throughput.py: PDF files on disk for the pipeline, and the same pages as the
engine requests the pipeline would send, for the engine-only run.

    paths = write_batch(folder, docs=100, pages_per_doc=10, seed=0)   # A4 invoice PDFs with a text layer
    units = render_units(paths, processes=8)          # vision.open_media, the pipeline's options (Settings())
    requests = [unit_request(u, spec.prompt, params, settings) for u in units]

The PDFs are bench/doc_workload.invoice_pdf's (A4, ~1.5-2k characters of text layer a page). The engine-only
units are rendered as pipeline.rendering renders them (vision with Settings.render_options() / media_limits(), at
the pipeline's dpi) and built into UnitInputs as pipeline.jobs does (the page image, its text layer as anchor text),
so both runs send the engine the same requests.
"""
from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from doc_workload import Unit, invoice_pdf


def write_batch(folder: Path, docs: int, pages_per_doc: int, seed: int) -> list[Path]:
    if docs < 1 or pages_per_doc < 1:
        raise ValueError(f"need docs >= 1 and pages_per_doc >= 1, got {docs} and {pages_per_doc}")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for d in range(docs):
        path = folder / f"invoices-{d:04d}.pdf"
        path.write_bytes(invoice_pdf(pages_per_doc, rng))
        paths.append(path)
    return paths


def _render(path: str) -> list[tuple[int, Any, str | None]]:
    """(page index, image, text layer) of every page of one file, rendered the pipeline's way (Settings from the
    environment, as the pipeline's own processes read them)."""
    import vision
    from pipeline.settings import Settings

    settings = Settings()
    with vision.open_media(Path(path).read_bytes(), limits=settings.media_limits(),
                           options=settings.render_options(), name=Path(path).name) as doc:
        pages = [(pg.index, pg.image, pg.text) for pg in doc.pages()]
    bad = [i for i, image, _ in pages if image is None]
    if bad:
        raise RuntimeError(f"{path}: pages {bad} did not render")
    return pages


def render_units(paths: list[Path], processes: int) -> list[Unit]:
    """Every page of every file as an extraction unit, in file then page order."""
    from pipeline.extraction import UnitInput

    if processes > 1:
        with ProcessPoolExecutor(max_workers=processes) as pool:
            rendered = list(pool.map(_render, [str(p) for p in paths]))
    else:
        rendered = [_render(str(p)) for p in paths]
    units = []
    for path, pages in zip(paths, rendered):
        size = path.stat().st_size // max(1, len(pages))
        for index, image, text in pages:
            unit = UnitInput(unit=f"page:{index}", page_index=index, images=[image], timestamps=[None],
                             anchor_text=text)
            units.append(Unit(len(units), "pdf", unit, size))
    return units
