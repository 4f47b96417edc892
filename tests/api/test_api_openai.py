"""The OpenAI-compatible endpoint, driven by the official `openai` client over real HTTP (tiny bundled model)."""
from __future__ import annotations

import base64
import io
import json
import random
import time

import httpx
import jsonschema
import openai
import pytest
from apitest_support import KEY, OPEN_LIMITS, SAMPLES, LiveServer, live_server, test_settings
from PIL import Image

from api.limits import ApiLimits
from gpu_engine.params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def data_url(width: int = 32, height: int = 32, fmt: str = "PNG") -> str:
    rng = random.Random()
    img = Image.frombytes("RGB", (width, height), bytes(rng.getrandbits(8) for _ in range(width * height * 3)))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def sqlite_server(tmp_path_factory: pytest.TempPathFactory):
    # Room for long answers (the disconnect test); other tests ask for a few tokens.
    limits = ApiLimits(**{**OPEN_LIMITS.__dict__, "max_completion_tokens": 4096})
    with live_server(test_settings(tmp_path_factory.mktemp("api-openai")), limits=limits) as live:
        yield live


@pytest.fixture(scope="module")
def client(sqlite_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=sqlite_server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_text_completion_matches_the_engine(client: openai.OpenAI, model_id: str,
                                             sqlite_server: LiveServer) -> None:
    words = " ".join(random.choice(["invoice", "total", "date", "name", "page"]) for _ in range(6))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words}]
    out = client.chat.completions.create(model=model_id, messages=messages, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == model_id
    assert out.system_fingerprint == sqlite_server.app.state.ctx.engine.async_engine().stats()["model_fingerprint"]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 0 and 1 <= out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # Independent reference: the same greedy request straight to the engine gives the same text and counts.
    engine = sqlite_server.app.state.ctx.engine.async_engine()
    ref = engine.generate(messages, SamplingParams(max_tokens=12, temperature=0.0), timeout=120)
    assert choice.message.content == ref.text
    assert out.usage.completion_tokens == ref.completion_tokens and out.usage.prompt_tokens == ref.prompt_tokens


def test_streaming_deltas_add_up_to_the_full_answer(client: openai.OpenAI, model_id: str) -> None:
    messages = [{"role": "user", "content": f"Count to {random.randint(3, 9)}."}]
    full = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_image_input(client: openai.OpenAI, model_id: str) -> None:
    text_only = client.chat.completions.create(
        model=model_id, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}]}])
    with_image = client.chat.completions.create(
        model=model_id, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url()}},
                                               {"type": "text", "text": "What is this?"}]}])
    assert with_image.choices[0].finish_reason in ("stop", "length")
    # The image adds its vision tokens to the prompt.
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_is_constrained(client: openai.OpenAI, model_id: str, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(fmt="JPEG")}},
                                             {"type": "text", "text": "Name and number, as JSON."}]}]
    if stream:
        chunks = client.chat.completions.create(model=model_id, messages=messages, max_tokens=48, temperature=0.7,
                                                seed=random.randrange(1000), response_format=fmt, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        out = client.chat.completions.create(model=model_id, messages=messages, max_tokens=48, temperature=0.7,
                                             seed=random.randrange(1000), response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


def test_video_parts(sqlite_server: LiveServer, model_id: str) -> None:
    frames = {"type": "video", "video": [data_url(), data_url(), data_url(), data_url()], "fps": 2.0}
    mp4 = SAMPLES / "pan.mp4"
    ask = {"type": "text", "text": "What happens?"}
    with sqlite_server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 4, "temperature": 0,
                                                 "messages": [{"role": "user", "content": [frames, ask]}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 10
        if mp4.is_file():  # a video file, decoded by vision's isolated decoder, its frames handed to the engine
            url = "data:video/mp4;base64," + base64.b64encode(mp4.read_bytes()).decode()
            part = {"type": "video_url", "video_url": {"url": url}, "fps": 1.0}
            r = c.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": [part, ask]}]})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > 10
        # Not a video at all, and a damaged one that looks like MP4: both refused with a reason.
        junk = "data:video/mp4;base64," + base64.b64encode(random.randbytes(300)).decode()
        r = c.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": junk}}]}]})
        assert r.status_code == 400 and r.json()["code"] == "invalid_video"
        damaged = "data:video/mp4;base64," + base64.b64encode(b"\0\0\0\x18ftypmp42" + random.randbytes(300)).decode()
        r = c.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": damaged}}]}]})
        assert r.status_code == 400 and r.json()["code"] == "invalid_video", r.text


def test_refusals(client: openai.OpenAI, model_id: str, sqlite_server: LiveServer) -> None:
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=remote, max_tokens=4)
    assert err.value.body["code"] == "remote_url_refused"
    broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=broken, max_tokens=4)
    assert err.value.body["code"] == "invalid_image"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=100_000)
    assert err.value.body["code"] == "max_tokens_too_large"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format=bad_schema)
    assert err.value.body["code"] == "invalid_json_schema"
    anon = openai.OpenAI(base_url=sqlite_server.base + "/v1", api_key="not-a-valid-key-000000", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        anon.models.list()
    r = httpx.post(sqlite_server.base + "/v1/chat/completions", json={"model": model_id, "messages": []})
    assert r.status_code == 401


def test_client_leaving_a_stream_cancels_the_engine_request(sqlite_server: LiveServer, model_id: str) -> None:
    engine = sqlite_server.app.state.ctx.engine.async_engine()
    aborted_before = engine.stats().get("finished_abort", 0)
    long_answer = {"type": "object", "properties": {"story": {"type": "string", "minLength": 3000}},
                   "required": ["story"]}
    body = {"model": model_id, "max_tokens": 4000, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": long_answer}}}
    with sqlite_server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "chat.completion.chunk"
    # The connection is closed after one event; the engine must stop generating for it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and engine.stats().get("finished_abort", 0) == aborted_before:
        time.sleep(0.05)
    assert engine.stats().get("finished_abort", 0) == aborted_before + 1


def test_logprobs_of_the_chosen_tokens(client: openai.OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Say something."}],
                                         max_tokens=6, temperature=0, logprobs=True)
    tokens = out.choices[0].logprobs.content
    assert len(tokens) == out.usage.completion_tokens
    assert all(t.logprob <= 0.0 for t in tokens)
    assert "".join(t.token for t in tokens) == out.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       logprobs=True, top_logprobs=3)
    assert err.value.body["code"] == "unsupported_parameter"


def test_the_served_model_name_is_docpipe_model_id_when_set(tmp_path) -> None:
    """Clients send `model`: the name GET /v1/models lists is DOCPIPE_MODEL_ID if set, else the checkpoint folder."""
    from api.engine_access import EngineAccess
    from pipeline.context import Pipeline

    named = Pipeline(test_settings(tmp_path / "a", model_id="acme-invoices"))
    plain = Pipeline(test_settings(tmp_path / "b"))
    try:
        assert EngineAccess(named, preload=False).model_id == "acme-invoices"
        assert EngineAccess(plain, preload=False).model_id == plain.settings.resolved_model_dir().name
    finally:
        named.close()
        plain.close()
