"""From rendered pages to engine requests, and from engine replies to validated results.

A document is split into extraction units: one per page for PDFs and images, one for a whole video (all sampled
frames in one video part, so the model sees motion and time). Each unit becomes one engine request whose output is
constrained by the schema (grammar), then parsed, validated with jsonschema and given per-field confidences.
"""
from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import jsonschema
from PIL import Image

from gpu_engine.params import MAX_LOOKUP_TEXT_CHARS, SamplingParams

from .confidence import Confidence, field_confidence
from .engine_client import EngineReply, EngineRequest
from .settings import Settings


@dataclass(frozen=True)
class PngImage:
    """A stored page image still as its PNG bytes (pipeline.page_prep decodes it in a preparation process)."""

    data: bytes


@dataclass
class UnitInput:
    """What one request is made of: `unit` is "page:N" or "video"; frames carry timestamps (seconds)."""

    unit: str
    page_index: int | None
    images: Sequence[Image.Image | PngImage]  # PngImage: still encoded, decoded where the prompt is prepared
    timestamps: list[float | None]
    anchor_text: str | None = None


@dataclass
class UnitOutcome:
    ok: bool
    data: Any | None
    confidence: Confidence | None
    raw_text: str | None
    error: str | None


def grammar_schema(json_schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The schema handed to the decoder: the stored schema, with free-text strings and arrays optionally bounded
    tighter (`Settings.grammar_caps`). Tightening only removes answers, so every output still validates against
    the stored schema."""
    max_len, max_items = settings.grammar_caps()
    if max_len is None and max_items is None:
        return json_schema
    out = copy.deepcopy(json_schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            kind = node.get("type")
            free_text = kind == "string" and not any(k in node for k in ("enum", "const", "pattern", "format"))
            if free_text and max_len is not None:
                node["maxLength"] = max(min(node.get("maxLength", max_len), max_len), node.get("minLength", 0))
            if kind == "array" and max_items is not None:
                node["maxItems"] = max(min(node.get("maxItems", max_items), max_items), node.get("minItems", 0))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(out)
    return out


def sampling_params(json_schema: dict[str, Any], settings: Settings) -> SamplingParams:
    return SamplingParams(
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        logprobs=True,
        json_schema=grammar_schema(json_schema, settings),
        timeout_s=settings.request_timeout_s,
    )


def sampling_record(params: SamplingParams) -> dict[str, Any]:
    """What a result stores about how it was sampled (the grammar is the schema: stored once, not per row)."""
    return {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "seed": params.seed}


def frame_times(timestamps: list[float | None], fps: float) -> list[float]:
    """Seconds of each sampled frame (video pages always carry one; a missing one is placed `1/fps` after the
    frame before it, so the list stays in time order)."""
    times: list[float] = []
    for t in timestamps:
        previous = times[-1] if times else None
        here = float(t) if t is not None else (0.0 if previous is None else previous + 1 / fps)
        times.append(here if previous is None else max(here, previous))
    return times


def build_prompt(schema_prompt: str, unit: UnitInput, anchor_chars: int) -> str:
    parts = [schema_prompt]
    if unit.unit.startswith("page:") and unit.page_index is not None:
        parts.append(f"This is page {unit.page_index + 1}.")
    text = (unit.anchor_text or "").strip()
    if text and anchor_chars > 0:
        # Anchor text (as in olmOCR): the PDF's own text layer helps the model read small print exactly.
        parts.append("Text layer of this page (may be incomplete or out of reading order):\n" + text[:anchor_chars])
    return "\n\n".join(parts)


def build_request(unit: UnitInput, schema_prompt: str, params: SamplingParams, settings: Settings) -> EngineRequest:
    """One unit's engine request. A page with a text layer hands the whole layer to the engine as `lookup_text`:
    prompt lookup drafts from it (speculative decoding; the output is unchanged by it) even where the prompt holds
    only its first anchor_text_chars (at most MAX_LOOKUP_TEXT_CHARS of it)."""
    text = (unit.anchor_text or "").strip()[:MAX_LOOKUP_TEXT_CHARS]  # the page's start if it holds more
    if text and unit.unit.startswith("page:"):
        params = dataclasses.replace(params, lookup_text=text)
    content: list[dict[str, Any]] = []
    if unit.unit == "video":
        # The frames were sampled at render time by the engine's rule (Settings.render_options): the engine takes
        # them at their timestamps instead of sampling them again.
        content.append({"type": "video", "video": unit.images,
                        "timestamps": frame_times(unit.timestamps, settings.video_fps)})
    else:
        content.extend({"type": "image", "image": image} for image in unit.images)
    content.append({"type": "text", "text": build_prompt(schema_prompt, unit, settings.anchor_text_chars)})
    return EngineRequest(messages=[{"role": "user", "content": content}], params=params)


class _NonFiniteNumber(ValueError):
    pass


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NonFiniteNumber(literal[:40])
    return value


def interpret_reply(reply: EngineReply, json_schema: dict[str, Any], max_tokens: int) -> UnitOutcome:
    """Parse and validate one answer. A bad answer is a failed unit with a reason, never an exception."""
    if reply.error or reply.finish_reason == "error":
        return UnitOutcome(False, None, None, reply.text or None, f"engine error: {reply.error or 'unknown'}")
    if reply.finish_reason == "abort":
        return UnitOutcome(False, None, None, reply.text or None,
                           "the engine aborted the request (timeout or shutdown)")
    try:
        data = json.loads(reply.text, parse_float=_finite_float)
    except _NonFiniteNumber as exc:
        return UnitOutcome(False, None, None, reply.text,
                           f"the answer has a number too large to represent ({exc}); bound it in the schema "
                           "with minimum/maximum")
    except json.JSONDecodeError as exc:
        if reply.finish_reason == "length":
            reason = (f"the answer was cut at max_tokens={max_tokens} before the JSON ended; raise DOCPIPE_MAX_TOKENS "
                      "or bound the schema (DOCPIPE_GRAMMAR_MAX_STRING_LENGTH / _ARRAY_ITEMS)")
        else:
            reason = f"the answer is not JSON ({exc.msg} at character {exc.pos})"
        return UnitOutcome(False, None, None, reply.text, reason)
    except ValueError as exc:  # e.g. an integer literal longer than Python converts
        return UnitOutcome(False, None, None, reply.text, f"the answer is not usable JSON: {exc}")
    errors = sorted(jsonschema.Draft202012Validator(json_schema).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = "/" + "/".join(str(p) for p in first.absolute_path)
        return UnitOutcome(False, None, None, reply.text,
                           f"the answer does not match the schema at {where}: {first.message}")
    try:
        confidence = field_confidence(reply.text, reply.token_texts, reply.token_logprobs)
    except ValueError:
        confidence = Confidence(overall=None, fields={})
    return UnitOutcome(True, data, confidence, reply.text, None)


def png_bytes(image: Image.Image) -> bytes:
    """Rendered pages are stored as PNG (lossless: small print must survive); level 1 trades size for speed."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def load_png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB") if image.mode != "RGB" else image


def decode_pngs(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every PngImage (an image part's image, a video part's frames) decoded by `load_png`,
    as the job thread decodes pages when it prepares them itself. Other values are kept as they are."""
    def decoded(value: Any) -> Any:
        return load_png(value.data) if isinstance(value, PngImage) else value

    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                part = dict(part)
                if part.get("type") == "image":
                    part["image"] = decoded(part.get("image"))
                elif part.get("type") == "video" and isinstance(part.get("video"), list):
                    part["video"] = [decoded(frame) for frame in part["video"]]
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out
