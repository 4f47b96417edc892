"""A seeded mixed stream of chat requests (text prompts and single-image prompts) and the statistics of a run.

make_stream: Poisson arrivals (exponential gaps with a fixed mean) from a seed; exactly half of the requests
(rounded down) carry one image of random pixels whose sides are drawn from [min_side, max_side] in steps of 32
(the 2B-class tower's merge factor), with a short question; the others are text of a few hundred words.
Same arguments -> the same stream (arrival times, texts, pixels).
summarize: time to first token and end-to-end latency p50 / p95 (numpy's default linear interpolation between
order statistics), generated tokens / s and images / s over the stream's wall time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Plain words: the bundled tokenizer splits them into a few tokens each.
_WORDS = ("invoice total amount date vendor address payment due account number customer order item quantity "
          "price tax shipping reference contract signature page section table summary report balance credit "
          "debit receipt statement period description unit discount currency remit bank branch phone email").split()


@dataclass(frozen=True)
class StreamRequest:
    index: int
    arrival_s: float  # seconds after the stream starts
    kind: str  # "text" | "image"
    messages: list[dict[str, Any]] = field(repr=False)
    image_size: tuple[int, int] | None = None  # (width, height) in pixels


def make_stream(n: int, seed: int, *, mean_gap_s: float = 0.05, text_words: tuple[int, int] = (150, 300),
                min_side: int = 448, max_side: int = 1024, side_step: int = 32) -> list[StreamRequest]:
    """`n` requests, half with one image; `text_words`: inclusive range of words in a text prompt."""
    if n < 1 or mean_gap_s < 0 or not 1 <= text_words[0] <= text_words[1] or not 0 < min_side <= max_side:
        raise ValueError(f"bad stream parameters: n={n}, mean_gap_s={mean_gap_s}, text_words={text_words}, "
                         f"sides=({min_side}, {max_side})")
    rng = np.random.default_rng(seed)
    kinds = np.array(["image"] * (n // 2) + ["text"] * (n - n // 2))
    rng.shuffle(kinds)
    arrivals = np.cumsum(rng.exponential(mean_gap_s, n))
    arrivals -= arrivals[0]  # the first request arrives at once
    sides = np.arange(-(-min_side // side_step) * side_step, max_side + 1, side_step)
    if sides.size == 0:
        raise ValueError(f"no side between {min_side} and {max_side} is a multiple of {side_step}")
    out = []
    for i, kind in enumerate(kinds):
        if kind == "image":
            width, height = (int(s) for s in rng.choice(sides, 2))
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            question = " ".join(rng.choice(_WORDS, int(rng.integers(4, 12))))
            content: Any = [{"type": "image", "image": _pil(pixels)}, {"type": "text", "text": f"Read the {question}."}]
            out.append(StreamRequest(i, float(arrivals[i]), "image", [{"role": "user", "content": content}],
                                     (width, height)))
        else:
            words = rng.choice(_WORDS, int(rng.integers(text_words[0], text_words[1] + 1)))
            text = "Extract the fields from this text: " + " ".join(words)
            out.append(StreamRequest(i, float(arrivals[i]), "text", [{"role": "user", "content": text}]))
    return out


def _pil(pixels: np.ndarray):
    from PIL import Image

    return Image.fromarray(pixels, "RGB")


@dataclass
class RequestTiming:
    index: int
    kind: str
    submitted: float  # perf_counter when the request was handed to the engine front (its arrival)
    first_token: float | None = None  # perf_counter of the first output carrying a token
    finished: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)
    logprobs: list[float] | None = field(default=None, repr=False)  # the chosen tokens', when requested

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def latency_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.submitted


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    p50, p95 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95])
    return {"p50": float(p50), "p95": float(p95)}


def summarize(timings: list[RequestTiming], wall_s: float) -> dict[str, Any]:
    """Latency percentiles (seconds), overall and per kind; throughput over `wall_s` (first arrival to last
    finish). Only requests that finished with "stop" or "length" enter the latency figures."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be positive, got {wall_s}")
    done = [t for t in timings if t.finish_reason in ("stop", "length") and t.ttft_s is not None]
    out: dict[str, Any] = {"requests": len(timings), "completed": len(done), "wall_s": wall_s}
    for label, group in (("all", done), ("text", [t for t in done if t.kind == "text"]),
                         ("image", [t for t in done if t.kind == "image"])):
        ttft = percentiles([t.ttft_s for t in group])  # type: ignore[misc]  # done: ttft_s is not None
        lat = percentiles([t.latency_s for t in group])  # type: ignore[misc]  # done: finished, so not None
        out[label] = {"count": len(group), "ttft_p50_s": ttft["p50"], "ttft_p95_s": ttft["p95"],
                      "latency_p50_s": lat["p50"], "latency_p95_s": lat["p95"]}
    out["generated_tokens"] = sum(t.completion_tokens for t in done)
    out["prompt_tokens"] = sum(t.prompt_tokens for t in done)
    out["tokens_per_s"] = out["generated_tokens"] / wall_s
    out["prompt_tokens_per_s"] = out["prompt_tokens"] / wall_s
    out["images_per_s"] = sum(1 for t in done if t.kind == "image") / wall_s
    return out


def check_timings(timings: list[RequestTiming], max_tokens: int) -> list[str]:
    """Every request must end by length with exactly max_tokens tokens (the stream runs with ignore_eos), and
    logprobs, where reported, must be finite (NaN or inf logits show up there)."""
    problems = []
    for t in timings:
        if t.finish_reason != "length" or t.completion_tokens != max_tokens or t.error:
            problems.append(f"request {t.index} ({t.kind}): finish_reason={t.finish_reason!r}, "
                            f"{t.completion_tokens}/{max_tokens} tokens, error={t.error!r}")
        elif t.logprobs is not None and (len(t.logprobs) != max_tokens or not np.all(np.isfinite(t.logprobs))):
            problems.append(f"request {t.index} ({t.kind}): logprobs not all finite: {t.logprobs[:6]}")
    return problems
