"""Images, videos and mixed conversations through a qwen3_5_moe model: gpu_engine.load(...).logits_for_messages /
generate vs transformers' Qwen3_5MoeForConditionalGeneration, on the three tiny MoE configs (moe_hf_models).

What transformers is fed, and the tolerances, as test_engine_vlm_parity (whose module docstring says why): our
processor's token ids, transformers' own image processor's pixels, our video frame patches; rel-L2 <= 1e-4 over all
positions and per position (or within float32 noise of a float64 run). Greedy 24-token generations (image, video)
are token-identical; chunked prefill with boundaries inside the placeholder spans equals the whole prefill.
"""
from __future__ import annotations

import numpy as np
import pytest
from ci_rule import require_module

torch = require_module("torch")
require_module("transformers")

from engine_hf_models import check_vlm_greedy_tokens, check_vlm_parity, float64_copy, random_frames, random_image
from moe_hf_models import MOE_HF_CONFIGS, build_hf_moe_vlm_checkpoint

import gpu_engine

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=sorted(MOE_HF_CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-vlm-" + request.param)
    seed = sorted(MOE_HF_CONFIGS).index(request.param) + 30
    hf, image_processor = build_hf_moe_vlm_checkpoint(request.param, folder, seed)
    return hf, image_processor, gpu_engine.load(folder)


@pytest.fixture(scope="module")
def hf64(pair):
    return float64_copy(pair[0])


def test_one_image(pair, hf64):
    rng = np.random.default_rng(1)
    image = random_image(rng, 45, 77)
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is it?"}]}]
    prompt = check_vlm_parity(pair, hf64, messages, [image], chunk_sizes=(1, 7))
    assert [item.kind for item in prompt.vision_items] == ["image"]


def test_video_of_at_least_eight_frames(pair, hf64):
    rng = np.random.default_rng(3)
    frames = random_frames(rng, 16, 40, 56)  # 16 frames at 4 fps -> 8 sampled at 2 fps -> 4 frame groups
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 4.0},
                                             {"type": "text", "text": "Describe the clip."}]}]
    prompt = check_vlm_parity(pair, hf64, messages, chunk_sizes=(5,))
    assert sum(item.grid_thw[0] for item in prompt.vision_items) * 2 >= 8


def test_mixed_multi_turn_conversation(pair, hf64):
    rng = np.random.default_rng(4)
    images = [random_image(rng, 50, 50), random_image(rng, 40, 90)]
    frames = random_frames(rng, 8, 32, 48)
    messages = [
        {"role": "system", "content": "You read documents."},
        {"role": "user", "content": [{"type": "image", "image": images[0]}, {"type": "text", "text": "Total?"},
                                     {"type": "image", "image": images[1]}]},
        {"role": "assistant", "content": "The total is 42."},
        {"role": "user", "content": [{"type": "text", "text": "And here?"},
                                     {"type": "video", "video": frames, "fps": 2.0}]},
    ]
    prompt = check_vlm_parity(pair, hf64, messages, images, chunk_sizes=(3,))
    assert [item.kind for item in prompt.vision_items][:2] == ["image", "image"]
    assert prompt.vision_items[-1].kind == "video"


def test_greedy_generation_with_an_image_is_token_identical(pair):
    rng = np.random.default_rng(5)
    image = random_image(rng, 64, 48)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Read it."}]}]
    check_vlm_greedy_tokens(pair, messages, [image])


def test_greedy_generation_with_a_video_is_token_identical(pair):
    rng = np.random.default_rng(6)
    frames = random_frames(rng, 12, 36, 52)
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 3.0},
                                             {"type": "text", "text": "What happens?"}]}]
    check_vlm_greedy_tokens(pair, messages, chunk_size=11)
