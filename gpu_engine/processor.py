"""Prompt building for Qwen3.5-family models: messages (OpenAI or HF style) -> chat template, each image / video
preprocessed (preprocessing.py, media from media_io.py), placeholders expanded, M-RoPE position ids
(rope_index.py). Numerically follows transformers 5.17 (Qwen3VLProcessor, Qwen3_5Model.get_rope_index).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .inputs import ProcessedPrompt, VisionItem, is_token_ids
from .media_io import frame_array, load_image
from .preprocessing import (
    ImageProcessor,
    ProcessedImage,
    ProcessedVideo,
    VideoProcessor,
)
from .processing_errors import ProcessorError
from .rope_index import find_vision_spans, rope_index, text_positions
from .tokenizer import Tokenizer, TokenizerError

# transformers' default when a frame list arrives without its sampling rate (Qwen3VLVideoProcessor.sample_frames).
DEFAULT_FRAME_LIST_FPS = 24.0


# --------------------------------------------------------------------------------------------- the processor


@dataclass(frozen=True)
class _Media:
    kind: str  # "image" | "video"
    source: Any
    fps: float | None
    what: str  # "message 2, part 1" — for error messages
    timestamps: tuple[float, ...] | None = None  # frames already sampled, at these times (seconds)


def _frame_times(value: Any, fps: Any, what: str) -> tuple[float, ...] | None:
    """A video part's `timestamps`: its frames are already sampled (by the caller, with
    gpu_engine.frame_sampling) and shown at these times, so the processor takes them as they are."""
    if value is None:
        return None
    if fps is not None:
        raise ProcessorError(f"{what}: give fps (frames to sample) or timestamps (frames already sampled), not both")
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise ProcessorError(f"{what}: timestamps must be a non-empty list of seconds, one per frame")
    times = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ProcessorError(f"{what}: timestamps must be finite seconds >= 0, got {t!r}")
        times.append(float(t))
    if any(b < a for a, b in zip(times, times[1:])):
        raise ProcessorError(f"{what}: timestamps must not decrease (frames in time order)")
    return tuple(times)


def _part_source(part: Mapping[str, Any], keys: Sequence[str], what: str) -> Any:
    for key in keys:
        if part.get(key) is not None:
            return part[key]
    raise ProcessorError(f"{what}: needs one of the keys {', '.join(keys)}")


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[_Media]]:
    """Validate messages and list their media in prompt order.

    OpenAI "image_url" parts become HF "image" parts (as transformers' processor does before templating), so a
    template sees the same messages there and here.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ProcessorError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    normalized: list[dict[str, Any]] = []
    media: list[_Media] = []
    for m_index, message in enumerate(messages):
        where = f"message {m_index}"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ProcessorError(f"{where}: must be a dict with a string 'role'")
        content = message.get("content")
        out = dict(message)
        if isinstance(content, list):
            parts = []
            for p_index, part in enumerate(content):
                what = f"{where}, part {p_index}"
                if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                    raise ProcessorError(f"{what}: must be a dict with a string 'type'")
                kind = part["type"]
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise ProcessorError(f"{what}: text part needs a string 'text'")
                    parts.append(dict(part))
                elif kind == "image":
                    source = _part_source(part, ("image", "url", "path", "base64"), what)
                    media.append(_Media("image", source, None, what))
                    parts.append(dict(part))
                elif kind == "image_url":
                    info = part.get("image_url")
                    url = info.get("url") if isinstance(info, Mapping) else info
                    if not isinstance(url, str):
                        raise ProcessorError(f"{what}: image_url part needs image_url.url")
                    media.append(_Media("image", url, None, what))
                    parts.append({"type": "image", "url": url})
                elif kind == "video":
                    fps = part.get("fps")
                    if fps is not None and (not isinstance(fps, (int, float)) or fps <= 0):
                        raise ProcessorError(f"{what}: fps must be a positive number, got {fps!r}")
                    timestamps = _frame_times(part.get("timestamps"), fps, what)
                    media.append(_Media("video", _part_source(part, ("video",), what), fps, what, timestamps))
                    parts.append(dict(part))
                else:
                    raise ProcessorError(f"{what}: unsupported content type {kind!r} (text, image, image_url, video)")
            out["content"] = parts
        elif content is not None and not isinstance(content, str):
            raise ProcessorError(f"{where}: content must be a string, a list of parts or None")
        normalized.append(out)
    return normalized, media


@dataclass(eq=False)  # identity, as before: two processors are the same only if they are one object
class Processor:
    """Messages (or token ids) -> ProcessedPrompt: expanded token ids, M-RoPE positions and vision items."""

    tokenizer: Tokenizer
    image_processor: ImageProcessor
    video_processor: VideoProcessor
    _: KW_ONLY
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int
    # the placeholder and vision start/end strings, looked up in the vocabulary at construction
    image_token: str = field(init=False)
    video_token: str = field(init=False)
    vision_start_token: str = field(init=False)
    vision_end_token: str = field(init=False)

    def __post_init__(self) -> None:
        tokenizer = self.tokenizer
        image_token = tokenizer.id_to_token(self.image_token_id)
        video_token = tokenizer.id_to_token(self.video_token_id)
        if image_token is None or video_token is None:  # fail early, as for the vision start/end tokens below
            raise TokenizerError(f"image_token_id {self.image_token_id} or video_token_id {self.video_token_id} is "
                                 "not in the vocabulary")
        self.image_token, self.video_token = image_token, video_token
        self.vision_start_token = tokenizer.special_tokens.get("vision_bos_token", "<|vision_start|>")
        self.vision_end_token = tokenizer.special_tokens.get("vision_eos_token", "<|vision_end|>")
        tokenizer.token_to_id(self.vision_start_token)  # fail early if the vocabulary lacks them
        tokenizer.token_to_id(self.vision_end_token)

    @classmethod
    def from_pretrained(cls, folder: str | Path, model_config: Any = None,
                        tokenizer: Tokenizer | None = None) -> Processor:
        """Load tokenizer + processor configs from a checkpoint folder.

        `model_config` (gpu_engine.config.ModelConfig, optional) supplies the placeholder ids and the vision
        merge size the model uses; they must agree with the tokenizer and processor configs. `tokenizer`: the
        folder's tokenizer if the caller already loaded it (loading a 248k-token vocabulary takes a while).
        """
        folder = Path(folder)
        tokenizer = tokenizer or Tokenizer.from_pretrained(folder)
        image_processor = ImageProcessor.from_pretrained(folder)
        video_processor = VideoProcessor.from_pretrained(folder)
        image_id = tokenizer.token_to_id(tokenizer.special_tokens.get("image_token", "<|image_pad|>"))
        video_id = tokenizer.token_to_id(tokenizer.special_tokens.get("video_token", "<|video_pad|>"))
        merge = image_processor.params.merge_size
        if model_config is not None:
            if (model_config.image_token_id, model_config.video_token_id) != (image_id, video_id):
                raise ProcessorError(
                    f"{folder}: config.json image/video token ids {model_config.image_token_id}/"
                    f"{model_config.video_token_id} differ from the tokenizer's {image_id}/{video_id}"
                )
            model_merge = model_config.vision.spatial_merge_size
            if model_merge != merge:
                raise ProcessorError(
                    f"{folder}: vision spatial_merge_size {model_merge} differs from the processor merge_size {merge}"
                )
        if video_processor.params.merge_size != merge:
            raise ProcessorError(f"{folder}: image and video processors disagree on merge_size")
        return cls(tokenizer, image_processor, video_processor,
                   image_token_id=image_id, video_token_id=video_id, spatial_merge_size=merge)

    # -- media ---------------------------------------------------------------------------------------------

    def process_image(self, source: Any, what: str = "image") -> ProcessedImage:
        return self.image_processor.preprocess(load_image(source, what))

    def process_video(self, source: Any, fps: float | None = None, what: str = "video",
                      timestamps: Sequence[float] | None = None) -> ProcessedVideo:
        """A list of decoded frames: all frames of a clip at `fps` frames per second, which are sampled here as
        transformers samples them, or frames already sampled and shown at `timestamps` (seconds), taken as they are.

        Video files are not decoded here: the engine holds no decoder, so a damaged stream cannot crash the process
        that runs the model. Decode them in an isolated process first (docpipe: `vision.open_media`)."""
        vp = self.video_processor
        if not (isinstance(source, (list, tuple)) or (isinstance(source, np.ndarray) and source.ndim == 4)):
            raise ProcessorError(
                f"{what}: a video must be a list of decoded frames, got {type(source).__name__}; the engine does not "
                "decode video files (decode them first, e.g. with docpipe's vision.open_media)"
            )
        all_frames = [frame_array(f, f"{what}, frame {i}") for i, f in enumerate(source)]
        if timestamps is not None:
            if len(timestamps) != len(all_frames):
                raise ProcessorError(f"{what}: {len(all_frames)} frames but {len(timestamps)} timestamps")
            return vp.preprocess(all_frames, timestamps)
        video_fps = float(fps) if fps is not None else DEFAULT_FRAME_LIST_FPS
        indices = vp.sample_indices(len(all_frames), video_fps)
        return vp.preprocess([all_frames[i] for i in indices], [int(i) / video_fps for i in indices])

    def _video_placeholder(self, video: ProcessedVideo) -> str:
        _, gh, gw = video.grid_thw
        per_group = gh * gw // self.spatial_merge_size**2
        return "".join(
            f"<{seconds:.1f} seconds>" + self.vision_start_token + self.video_token * per_group + self.vision_end_token
            for seconds in video.timestamps
        )

    # -- prompts -------------------------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               enable_thinking: bool = False) -> str:
        """The chat-template string before placeholder expansion (what processor.apply_chat_template returns)."""
        return self._render(messages, add_generation_prompt, enable_thinking)[0]

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                enable_thinking: bool) -> tuple[str, list[_Media]]:
        normalized, media = _normalize_messages(messages)
        text = self.tokenizer.apply_chat_template(
            normalized, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
        )
        return text, media

    def prepare(
        self,
        messages_or_token_ids: Sequence[Mapping[str, Any]] | Sequence[int] | np.ndarray,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> ProcessedPrompt:
        """Build the engine's input. Token ids are taken as a finished text-only prompt."""
        if is_token_ids(messages_or_token_ids):
            return self._prepare_token_ids(np.asarray(messages_or_token_ids, dtype=np.int64))
        text, media = self._render(messages_or_token_ids, add_generation_prompt, enable_thinking)
        processed: list[ProcessedImage | ProcessedVideo] = [
            self.process_image(m.source, m.what) if m.kind == "image"
            else self.process_video(m.source, m.fps, m.what, m.timestamps)
            for m in media
        ]
        expanded = self._expand(text, media, processed)
        token_ids = np.asarray(self.tokenizer.encode(expanded), dtype=np.int64)
        image_grids = [p.grid_thw for p in processed if isinstance(p, ProcessedImage)]
        video_grids = [p.grid_thw for p in processed if isinstance(p, ProcessedVideo)]
        positions, delta = rope_index(
            token_ids, image_grid_thw=image_grids, video_grid_thw=video_grids,
            image_token_id=self.image_token_id, video_token_id=self.video_token_id,
            spatial_merge_size=self.spatial_merge_size,
        )
        items = self._vision_items(token_ids, processed)
        return ProcessedPrompt(token_ids=token_ids, positions=positions, rope_delta=delta, vision_items=items)

    def _expand(self, text: str, media: list[_Media], processed: list[ProcessedImage | ProcessedVideo]) -> str:
        """Replace each placeholder token, in order, by its expansion (as transformers' processor does)."""
        pattern = re.compile(f"({re.escape(self.image_token)})|({re.escape(self.video_token)})")
        found = [("image" if m.group(1) else "video") for m in pattern.finditer(text)]
        expected = [m.kind for m in media]
        if found != expected:
            raise ProcessorError(
                f"the chat template produced placeholders {found} but the messages carry media {expected} "
                "(text that contains a placeholder token literally is not allowed)"
            )
        merge_area = self.spatial_merge_size**2
        replacements = iter(
            self.image_token * (p.num_tokens // merge_area) if isinstance(p, ProcessedImage)
            else self._video_placeholder(p)
            for p in processed
        )
        return pattern.sub(lambda _: next(replacements), text)

    def _vision_items(self, token_ids: np.ndarray,
                      processed: list[ProcessedImage | ProcessedVideo]) -> list[VisionItem]:
        spans = iter(find_vision_spans(token_ids, self.image_token_id, self.video_token_id))
        items: list[VisionItem] = []
        for p in processed:
            if isinstance(p, ProcessedImage):
                span = next(spans)
                items.append(VisionItem("image", p.pixel_values, p.grid_thw, span.start, span.length, p.content_hash))
            else:
                for group in p.frame_groups:
                    span = next(spans)
                    items.append(VisionItem("video", group.pixel_values, group.grid_thw, span.start, span.length,
                                            group.content_hash, timestamp=group.timestamp))
        return items

    def _prepare_token_ids(self, token_ids: np.ndarray) -> ProcessedPrompt:
        if token_ids.ndim != 1 or len(token_ids) == 0:
            raise ProcessorError("token ids must be a non-empty 1-D sequence")
        if np.isin(token_ids, [self.image_token_id, self.video_token_id]).any():
            raise ProcessorError(
                "token ids contain image/video placeholder tokens but carry no pixels; pass messages with media instead"
            )
        if token_ids.min() < 0:
            raise ProcessorError("token ids must be non-negative")
        positions = text_positions(len(token_ids))
        return ProcessedPrompt(token_ids=token_ids.copy(), positions=positions, rope_delta=0)
