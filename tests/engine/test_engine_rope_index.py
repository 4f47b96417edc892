"""M-RoPE position ids vs transformers' Qwen3_5Model.get_rope_index (integer results: exact equality)."""
from __future__ import annotations

import functools
import types

import numpy as np
import pytest
from ci_rule import require_module

from gpu_engine.processing_errors import ProcessorError
from gpu_engine.rope_index import find_vision_spans, rope_index

torch = require_module("torch")
modeling = require_module("transformers.models.qwen3_5.modeling_qwen3_5")
torch.set_num_threads(1)

IMAGE, VIDEO, START, END, TEXT_MAX = 900, 901, 902, 903, 800


def _hf_rope_index(ids, types_, image_grids, video_grids, merge):
    """Call transformers' get_rope_index without building a model: it only reads config and one helper."""
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge))
    )
    fake.get_vision_position_ids = functools.partial(modeling.Qwen3_5Model.get_vision_position_ids, fake)
    positions, delta = modeling.Qwen3_5Model.get_rope_index(
        fake,
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([types_]),
        image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None,
    )
    return positions[:, 0].numpy(), int(delta[0, 0])


def _random_prompt(rng: np.random.Generator, merge: int):
    """Text runs, images and videos in random order, laid out like the processor does (timestamps between groups)."""
    ids: list[int] = []
    image_grids: list[list[int]] = []
    video_grids: list[list[int]] = []

    def text(n: int) -> None:
        ids.extend(rng.integers(0, TEXT_MAX, n).tolist())

    text(int(rng.integers(0, 6)))
    for _ in range(int(rng.integers(0, 5))):
        h, w = (int(v) * merge for v in rng.integers(1, 7, 2))
        if rng.random() < 0.5:
            image_grids.append([1, h, w])
            ids.extend([START] + [IMAGE] * (h * w // merge**2) + [END])
        else:
            t = int(rng.integers(1, 5))
            video_grids.append([t, h, w])
            ids.append(START)
            for _ in range(t):
                text(int(rng.integers(1, 5)))  # "<0.5 seconds>"
                ids.extend([START] + [VIDEO] * (h * w // merge**2) + [END])
            ids.append(END)
        text(int(rng.integers(0, 6)))
    if not ids:
        text(3)
    types_ = [1 if i == IMAGE else 2 if i == VIDEO else 0 for i in ids]
    return ids, types_, image_grids, video_grids


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_rope_index_matches_transformers_on_random_mixes(merge: int) -> None:
    rng = np.random.default_rng()  # fresh layouts every run
    for _ in range(25):
        ids, types_, image_grids, video_grids = _random_prompt(rng, merge)
        expected, expected_delta = _hf_rope_index(ids, types_, image_grids, video_grids, merge)
        positions, delta = rope_index(
            ids, image_grid_thw=image_grids, video_grid_thw=video_grids,
            image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=merge,
        )
        np.testing.assert_array_equal(positions, expected)
        assert delta == expected_delta
        assert positions.dtype == np.int64 and positions.shape == (3, len(ids))


def test_text_only_positions_are_plain() -> None:
    positions, delta = rope_index([5, 6, 7, 8], image_grid_thw=None, video_grid_thw=None,
                                  image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2)
    np.testing.assert_array_equal(positions, np.tile(np.arange(4), (3, 1)))
    assert delta == 0


def test_known_small_layout() -> None:
    # 2 text tokens, one 4x6 image (merge 2 -> 2x3 tokens), 1 text token.
    ids = [1, 2] + [IMAGE] * 6 + [3]
    positions, delta = rope_index(ids, image_grid_thw=[[1, 4, 6]], video_grid_thw=None,
                                  image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2)
    np.testing.assert_array_equal(positions[0], [0, 1, 2, 2, 2, 2, 2, 2, 5])
    np.testing.assert_array_equal(positions[1], [0, 1, 2, 2, 2, 3, 3, 3, 5])
    np.testing.assert_array_equal(positions[2], [0, 1, 2, 3, 4, 2, 3, 4, 5])
    assert delta == 6 - 9


def test_find_vision_spans() -> None:
    spans = find_vision_spans(np.array([IMAGE, IMAGE, 1, VIDEO, VIDEO, VIDEO, IMAGE]), IMAGE, VIDEO)
    assert [(s.kind, s.start, s.length) for s in spans] == [("image", 0, 2), ("video", 3, 3), ("image", 6, 1)]


def test_grid_count_mismatch_is_an_error() -> None:
    with pytest.raises(ProcessorError, match="1 image placeholder runs .* 2 image grids"):
        rope_index([1] + [IMAGE] * 4, image_grid_thw=[[1, 4, 4], [1, 4, 4]], video_grid_thw=None,
                   image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2)
    with pytest.raises(ProcessorError, match="video grids count once per frame group"):
        rope_index([VIDEO] * 4, image_grid_thw=None, video_grid_thw=[[2, 4, 4]],
                   image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2)


def test_run_length_mismatch_is_an_error() -> None:
    with pytest.raises(ProcessorError, match="has 3 placeholders but its grid"):
        rope_index([1] + [IMAGE] * 3, image_grid_thw=[[1, 4, 4]], video_grid_thw=None,
                   image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2)


def test_empty_sequence_is_an_error() -> None:
    with pytest.raises(ProcessorError, match="non-empty"):
        rope_index([], image_grid_thw=None, video_grid_thw=None,
                   image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2)
