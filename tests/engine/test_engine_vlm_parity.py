"""Images, videos and mixed conversations: gpu_engine.load(...).logits_for_messages / generate vs transformers'
Qwen3_5ForConditionalGeneration, on three tiny random configs.

What transformers is fed: the token ids of our processor (chat template + placeholder expansion; byte-equality
of those with transformers' processor is the processor's own test) and, for images, the pixel values of
transformers' own image processor (its PIL backend; the torchvision one is not installed here). For videos
transformers' video processor needs torchvision, so the model is fed our processor's frame patches (equal to
transformers' video processor's within 1e-6: test_engine_processor).

Tolerances (engine_hf_models.assert_logit_parity; test_engine_text_parity says why): relative L2 error over all
positions' logits <= 1e-4, and at every position <= 1e-4 or, against a float64 transformers run, within twice
transformers-float32's own distance from it (+1e-5). Greedy 24-token generations (image, video) are token-identical.
Chunked prefill (chunk boundaries inside the placeholder spans) vs whole: <= 1e-5 over all logits.
"""
from __future__ import annotations

import numpy as np
import pytest
from ci_rule import require_module

torch = require_module("torch")
require_module("transformers")

from engine_hf_models import (
    HF_CONFIGS,
    build_hf_vlm_checkpoint,
    check_vlm_greedy_tokens,
    check_vlm_parity,
    float64_copy,
    random_frames,
    random_image,
)

import gpu_engine

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm-" + request.param)
    seed = sorted(HF_CONFIGS).index(request.param) + 10
    hf, image_processor = build_hf_vlm_checkpoint(request.param, folder, seed)
    return hf, image_processor, gpu_engine.load(folder)


@pytest.fixture(scope="module")
def hf64(pair):
    return float64_copy(pair[0])


def test_one_image(pair, hf64):
    rng = np.random.default_rng(1)
    image = random_image(rng, 45, 77)
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is it?"}]}]
    prompt = check_vlm_parity(pair, hf64, messages, [image], chunk_sizes=(1, 7, 64))
    assert len(prompt.vision_items) == 1


def test_two_images_of_different_sizes(pair, hf64):
    rng = np.random.default_rng(2)
    images = [random_image(rng, 61, 33), random_image(rng, 40, 90)]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image", "image": images[0]},
        {"type": "text", "text": "with"}, {"type": "image", "image": images[1]},
    ]}]
    prompt = check_vlm_parity(pair, hf64, messages, images)
    assert prompt.vision_items[0].grid_thw != prompt.vision_items[1].grid_thw


def test_video_of_at_least_eight_frames(pair, hf64):
    rng = np.random.default_rng(3)
    frames = random_frames(rng, 16, 40, 56)  # 16 frames at 4 fps -> 8 sampled at 2 fps -> 4 frame groups
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 4.0},
                                             {"type": "text", "text": "Describe the clip."}]}]
    prompt = check_vlm_parity(pair, hf64, messages, chunk_sizes=(5, 64))
    assert sum(item.grid_thw[0] for item in prompt.vision_items) * 2 >= 8


def test_mixed_multi_turn_conversation(pair, hf64):
    rng = np.random.default_rng(4)
    image = random_image(rng, 50, 50)
    frames = random_frames(rng, 8, 32, 48)
    messages = [
        {"role": "system", "content": "You read documents."},
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Total?"}]},
        {"role": "assistant", "content": "The total is 42."},
        {"role": "user", "content": [{"type": "text", "text": "And here?"},
                                     {"type": "video", "video": frames, "fps": 2.0}]},
    ]
    prompt = check_vlm_parity(pair, hf64, messages, [image], chunk_sizes=(3, 16))
    assert [item.kind for item in prompt.vision_items][0] == "image" and prompt.vision_items[-1].kind == "video"


def test_greedy_generation_with_an_image_is_token_identical(pair):
    rng = np.random.default_rng(5)
    image = random_image(rng, 64, 48)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Read it."}]}]
    check_vlm_greedy_tokens(pair, messages, [image])


def test_greedy_generation_with_a_video_is_token_identical(pair):
    rng = np.random.default_rng(6)
    frames = random_frames(rng, 12, 36, 52)  # 12 frames at 3 fps -> 8 sampled at 2 fps -> 4 frame groups
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 3.0},
                                             {"type": "text", "text": "What happens?"}]}]
    check_vlm_greedy_tokens(pair, messages, chunk_size=11)
