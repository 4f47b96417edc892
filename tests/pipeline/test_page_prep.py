"""pipeline.page_prep: prompts prepared in child processes equal the engine's own, and every failure of a child
(refusal, death, hang, bad PNG, full shared memory) ends the way the module promises, leaving no pixel file."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from PIL import Image

from gpu_engine.errors import RequestError
from pipeline.engine_client import EngineClient, EngineRequest
from pipeline.extraction import PngImage, decode_pngs, png_bytes
from pipeline.page_prep import FILE_PREFIX, PagePrepError, PagePrepPool, PrepNoSpace, remove_orphan_files
from pipeline.page_prep_child import build_prepare
from pipeline.settings import Settings


class _ExitOnLoad:
    """Unpickled in the child, it ends that process at once (a child that dies on this request)."""

    def __reduce__(self) -> Any:
        return (os._exit, (7,))


class _SleepOnLoad:
    """Unpickled in the child, it holds that process far past the pool's timeout (a child that hangs)."""

    def __reduce__(self) -> Any:
        return (time.sleep, (60,))


def _page(seed: int, size: tuple[int, int] = (96, 64)) -> bytes:
    rng = np.random.default_rng(seed)
    return png_bytes(Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB"))


def _image_messages(data: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image", "image": data}, {"type": "text", "text": "Read it."}]}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Settings().resolved_model_dir()


@pytest.fixture(scope="module")
def prepare(model_dir: Path) -> Any:
    return build_prepare(model_dir)


@pytest.fixture
def pool(model_dir: Path, tmp_path: Path) -> Iterator[PagePrepPool]:
    made = PagePrepPool(model_dir, 1, timeout_s=20.0, pixel_dir=tmp_path)
    yield made
    made.close()
    assert not list(tmp_path.glob(f"{FILE_PREFIX}*"))  # whatever happened, no pixel file is left


def _same(got: Any, want: Any) -> None:
    assert np.array_equal(got.token_ids, want.token_ids) and np.array_equal(got.positions, want.positions)
    assert got.rope_delta == want.rope_delta and len(got.vision_items) == len(want.vision_items)
    for a, b in zip(got.vision_items, want.vision_items):
        assert (a.kind, a.grid_thw, a.token_start, a.num_tokens, a.content_hash, a.timestamp) == \
            (b.kind, b.grid_thw, b.token_start, b.num_tokens, b.content_hash, b.timestamp)
        assert a.pixel_values.dtype == np.float32 and np.array_equal(a.pixel_values, b.pixel_values)


def test_an_image_page_and_a_video_equal_the_engines_own_preparation(pool: PagePrepPool, prepare: Any) -> None:
    page = _image_messages(PngImage(_page(0)))
    _same(pool.prepare(page), prepare(decode_pngs(page)))
    frames = [PngImage(_page(i, (64, 64))) for i in range(4)]
    video = [{"role": "user", "content": [{"type": "video", "video": frames, "timestamps": [0.0, 0.5, 1.0, 1.5]},
                                          {"type": "text", "text": "What happens?"}]}]
    got = pool.prepare(video)
    assert len(got.vision_items) == 2  # two frame groups, in one pixel file at two offsets
    _same(got, prepare(decode_pngs(video)))
    text_only = [{"role": "user", "content": "no media"}]
    _same(pool.prepare(text_only), prepare(text_only))  # no pixels: no file


def test_a_refused_request_raises_the_engines_request_error(pool: PagePrepPool) -> None:
    bad = [{"role": "user", "content": [{"type": "sound", "sound": b""}]}]
    with pytest.raises(RequestError, match="cannot prepare the messages: .*unsupported content type 'sound'"):
        pool.prepare(bad)
    assert pool.deaths == 0 and pool.prepare(_image_messages(PngImage(_page(1)))).vision_items


def test_a_png_that_does_not_decode_is_the_jobs_error_and_the_child_lives_on(pool: PagePrepPool) -> None:
    with pytest.raises(PagePrepError, match="UnidentifiedImageError"):
        pool.prepare(_image_messages(PngImage(b"not a png")))
    assert pool.deaths == 0 and pool.prepare(_image_messages(PngImage(_page(2)))).vision_items


def test_a_child_that_died_is_replaced_and_the_request_tried_again(pool: PagePrepPool, prepare: Any) -> None:
    child = next(iter(pool._children))
    child.process.kill()  # dies while idle (an OOM kill between two requests)
    child.process.wait()
    page = _image_messages(PngImage(_page(3)))
    _same(pool.prepare(page), prepare(decode_pngs(page)))
    assert pool.deaths == 1


def test_a_request_that_kills_its_child_twice_fails_with_the_exit_status(pool: PagePrepPool) -> None:
    with pytest.raises(PagePrepError, match=r"died twice on this request \(exit code 7\)"):
        pool.prepare(_image_messages(_ExitOnLoad()))
    assert pool.deaths == 2
    assert pool.prepare(_image_messages(PngImage(_page(4)))).vision_items  # a fresh child took over


def test_a_child_past_the_timeout_is_killed_and_replaced(model_dir: Path, tmp_path: Path) -> None:
    pool = PagePrepPool(model_dir, 1, timeout_s=1.0, pixel_dir=tmp_path)
    try:
        with pytest.raises(PagePrepError, match="took more than 1 s"):
            pool.prepare(_image_messages(_SleepOnLoad()))
        assert pool.deaths == 1
        assert pool.prepare(_image_messages(PngImage(_page(5)))).vision_items
    finally:
        pool.close()
    with pytest.raises(PagePrepError, match="closed"):
        pool.prepare(_image_messages(PngImage(_page(5))))


def test_a_pool_that_cannot_load_the_processor_says_so(tmp_path: Path) -> None:
    with pytest.raises(PagePrepError, match="could not load the prompt processor"):
        PagePrepPool(tmp_path / "no-model", 1, timeout_s=5.0, pixel_dir=tmp_path)


def test_files_of_a_dead_parent_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dead = 2**22 + 12345  # above the default pid_max: no process has it
    (tmp_path / f"{FILE_PREFIX}{dead}-0").write_bytes(b"x")
    (tmp_path / f"{FILE_PREFIX}{os.getpid()}-0").write_bytes(b"x")
    assert remove_orphan_files(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{FILE_PREFIX}{os.getpid()}-0"]


class _FullShm:
    def prepare(self, messages: Any) -> Any:
        raise PrepNoSpace("cannot write 53 MB of pixels in /dev/shm: No space left on device")

    def close(self) -> None:
        pass


def _client(engine_client: Any, preparer: Any) -> EngineClient:
    return EngineClient(engine_client.async_engine, model_dir=Settings().resolved_model_dir(),
                        fingerprint=engine_client.model_fingerprint, timeout_s=60.0, preparer=preparer)


def test_the_client_answers_alike_with_the_pool_without_it_and_when_shm_is_full(
        engine_client: Any, pool: PagePrepPool) -> None:
    from gpu_engine.params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0)
    data = _page(6)
    plain = next(iter(engine_client.run([EngineRequest(_image_messages(Image.open(_bytes_io(data))), params)])))
    pooled_client = _client(engine_client, pool)
    assert pooled_client.prepares_pages
    pooled = next(iter(pooled_client.run([EngineRequest(_image_messages(PngImage(data)), params)])))
    fallback = next(iter(_client(engine_client, _FullShm()).run([EngineRequest(_image_messages(PngImage(data)),
                                                                              params)])))
    assert plain.error is None and (pooled.text, pooled.prompt_tokens) == (plain.text, plain.prompt_tokens)
    assert (fallback.text, fallback.prompt_tokens) == (plain.text, plain.prompt_tokens)
    refused = next(iter(pooled_client.run([EngineRequest([{"role": "user", "content": [{"type": "x"}]}], params)])))
    assert refused.finish_reason == "error"
    assert "the engine refused the request: cannot prepare" in (refused.error or "")


def test_client_prepare_is_what_the_client_submits(engine_client: Any, pool: PagePrepPool) -> None:
    """EngineClient.prepare (the benches' engine-alone runs use it): the messages as they are without a pool, the
    pool's ProcessedPrompt with one, the PNGs decoded in-process when /dev/shm is full, RequestError when refused."""
    from gpu_engine.errors import RequestError
    from gpu_engine.inputs import ProcessedPrompt

    messages = _image_messages(PngImage(_page(6)))
    assert _client(engine_client, None).prepare(messages) is messages
    pooled = _client(engine_client, pool).prepare(messages)
    assert isinstance(pooled, ProcessedPrompt) and len(pooled.vision_items) == 1
    fallback = _client(engine_client, _FullShm()).prepare(messages)
    assert not isinstance(fallback, ProcessedPrompt)
    assert isinstance(fallback[0]["content"][0]["image"], Image.Image)  # decoded here for the engine
    with pytest.raises(RequestError, match="cannot prepare"):
        _client(engine_client, pool).prepare([{"role": "user", "content": [{"type": "x"}]}])


def _bytes_io(data: bytes) -> Any:
    import io

    return io.BytesIO(data)


def test_prep_processes_default_to_off_on_reference_and_on_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.threads

    assert Settings().prep_processes() == 0
    monkeypatch.setattr(pipeline.threads, "usable_cpus", lambda: 16)
    assert Settings(runner="cuda").prep_processes() == 4
    monkeypatch.setattr(pipeline.threads, "usable_cpus", lambda: 2)
    assert Settings(runner="cuda").prep_processes() == 1
    assert Settings(runner="cuda", engine_prep_processes=0).prep_processes() == 0
    assert Settings(engine_prep_processes=3).prep_processes() == 3


def test_a_job_run_through_the_pool_stores_the_results_of_one_without_it(
        engine_client: Any, pool: PagePrepPool, make_pipeline: Any, inputs: list[Path]) -> None:
    from sqlalchemy import select

    from pipeline.models import Result
    from pipeline.processing import process_paths

    pdf = next(p for p in inputs if p.suffix.lower() == ".pdf")
    texts = []
    for client, name in ((engine_client, "plain.sqlite"), (_client(engine_client, pool), "pooled.sqlite")):
        p = make_pipeline(f"sqlite:///{pool.pixel_dir / name}", client=client, image_cache_bytes=0)
        report = process_paths(p, [pdf])
        assert [f.state for f in report.files] == ["succeeded"], [(f.name, f.error) for f in report.files]
        with p.db.read_session() as s:
            texts.append(list(s.execute(select(Result.unit, Result.raw_text, Result.ok).order_by(Result.unit))))
    assert texts[0] == texts[1] and len(texts[0]) > 1


def test_pixel_files_go_to_the_temp_folder_when_shared_memory_is_too_small() -> None:
    import tempfile

    from pipeline.page_prep import default_pixel_dir

    assert default_pixel_dir(1 << 62) == Path(tempfile.gettempdir())  # no /dev/shm holds 4 EiB
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        assert default_pixel_dir(0) == Path("/dev/shm")
