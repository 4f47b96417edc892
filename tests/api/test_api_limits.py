"""Per-key limits over HTTP (429 + Retry-After) and the pieces behind them and behind auth, tested on their own."""
from __future__ import annotations

import base64
import io
import random
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import typer
from apitest_support import KEY, OTHER_KEY, live_server, test_settings
from PIL import Image
from typer.testing import CliRunner

from api.auth import KeyRing, key_id, presented_key
from api.cli import BindRefused, check_bind, is_loopback, register
from api.errors import ApiError, BodyTooLarge, RateLimited
from api.limits import ApiLimits, EngineSlots, JobQuota, RateLimiter
from api.media import MediaBudget, decode_image
from api.queries import decode_cursor, encode_cursor
from gpu_engine.data_url import DataUrlError, parse_data_url

# --- over HTTP --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory):
    limits = ApiLimits(rate_per_minute=60, burst=5, max_inflight_jobs=2, max_inflight_engine=1,
                       max_upload_bytes=1024 * 1024, max_completion_tokens=64, upload_idle_timeout_s=1)
    # max_tokens=4: every extraction is cut short, so jobs end `failed` (used by the retry test).
    settings = test_settings(tmp_path_factory.mktemp("api-tight"), max_tokens=4)
    with live_server(settings, limits=limits) as live:
        yield live


def _png() -> bytes:
    img = Image.frombytes("RGB", (16, 16), random.randbytes(16 * 16 * 3))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def test_rate_limit_per_key_with_retry_after(tight_server) -> None:
    with tight_server.client(key=OTHER_KEY) as c:
        codes = [c.get("/v1/schemas").status_code for _ in range(8)]
        assert codes[:5] == [200] * 5 and 429 in codes[5:]
        r = c.get("/v1/schemas")
        assert r.status_code == 429 and r.json()["code"] == "rate_limited"
        assert int(r.headers["Retry-After"]) >= 1
        # Health stays reachable for the limited key; other keys have their own budget.
        assert c.get("/healthz").status_code == 200
    with tight_server.client(key=KEY) as other:
        assert other.get("/v1/schemas").status_code == 200


def _patient(c: httpx.Client, method: str, path: str, **kw):
    """One request, waiting out the request-rate limit (429 rate_limited) as a well-behaved client does."""
    while True:
        r = c.request(method, path, **kw)
        if r.status_code != 429 or r.json()["code"] != "rate_limited":
            return r
        time.sleep(int(r.headers["Retry-After"]))


def test_in_flight_job_cap_and_retry(tight_server) -> None:
    with tight_server.client(key=KEY, timeout=60) as c:
        # The cap is 2 queued/running jobs per key: a batch of 3 new files cannot fit, whatever runs now.
        files = [("files", (f"f{i}.png", _png())) for i in range(3)]
        refused = _patient(c, "POST", "/v1/batches", files=files)
        assert refused.status_code == 429 and refused.json()["code"] == "too_many_jobs"
        assert int(refused.headers["Retry-After"]) >= 1
        accepted = [_patient(c, "POST", "/v1/documents", files={"file": ("s.png", _png())}).json()]
        job_id = accepted[0]["job"]["id"]
        deadline = time.monotonic() + 60
        job = _patient(c, "GET", f"/v1/jobs/{job_id}").json()
        while job["state"] in ("queued", "running") and time.monotonic() < deadline:
            time.sleep(0.5)
            job = _patient(c, "GET", f"/v1/jobs/{job_id}").json()
        assert job["state"] == "failed" and "max_tokens" in job["error"]  # 4 tokens cannot hold a JSON answer
        r = _patient(c, "POST", f"/v1/jobs/{job_id}/retry")
        assert r.status_code == 202, r.text
        assert r.json()["state"] in ("queued", "running", "failed") and r.json()["attempts"] <= 1


def test_engine_requests_are_capped_per_key(tight_server) -> None:
    """One chat request per key at a time: while a stream is open, a second request from the key gets 429."""
    time.sleep(3)  # let OTHER_KEY's request budget (drained by the rate-limit test) refill
    headers = {"Authorization": f"Bearer {OTHER_KEY}"}
    with httpx.Client(base_url=tight_server.base, headers=headers, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 64, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "Tell a long story."}]}
        with c.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200
            second = c.post("/v1/chat/completions", json={**body, "stream": False})
            assert second.status_code == 429 and second.json()["code"] == "too_many_engine_requests"
            assert "Retry-After" in second.headers
            text = "".join(stream.iter_text())
        assert text.rstrip().endswith("data: [DONE]")
        time.sleep(1.5)
        again = c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert again.status_code == 200, again.text  # the slot was given back when the stream ended


def test_a_stalled_upload_is_cut_off(tight_server) -> None:
    """Headers and part of the body, then silence: 408 after the idle timeout, no file left behind."""
    time.sleep(2)  # request budget
    url = urlparse(tight_server.base)
    head = (f"POST /v1/documents HTTP/1.1\r\nHost: {url.netloc}\r\nX-API-Key: {KEY}\r\n"
            "Content-Type: multipart/form-data; boundary=B\r\nContent-Length: 100000\r\n\r\n"
            "--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"s.png\"\r\n\r\n").encode()
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        sock.sendall(head + random.randbytes(1000))
        started = time.monotonic()
        reply = sock.recv(65536)
        waited = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"upload_stalled" in reply or b"problem+json" in reply
    assert 0.5 < waited < 10
    spool = tight_server.app.state.ctx.spool_dir
    assert not spool.exists() or list(spool.iterdir()) == []


# --- the pieces -------------------------------------------------------------------------------------------------


def test_keyring_matches_only_configured_keys() -> None:
    from pipeline.tenancy import Access

    keys = ["a" * 20 + str(random.random()), "b" * 24]
    ring = KeyRing([keys[0], f"acme:{keys[1]}", f"*:{'c' * 16}"])
    assert ring.enabled and not KeyRing([]).enabled
    assert ring.match(keys[0]) == (key_id(keys[0]), Access())  # a plain key: the default tenant
    assert ring.match(keys[1]) == (key_id(keys[1]), Access("acme"))
    assert ring.match("c" * 16) == (key_id("c" * 16), Access(admin=True))
    assert ring.match(f"acme:{keys[1]}") is None  # the tenant is configuration, not part of the key
    assert ring.match(keys[0][:-1]) is None and ring.match("") is None and ring.match(keys[0] + "x") is None
    assert key_id(keys[0]) != key_id(keys[1]) and keys[0] not in key_id(keys[0])


def test_a_short_key_is_refused_without_echoing_any_key() -> None:
    from pipeline.tenancy import parse_key_entries

    good = "g" * 24
    with pytest.raises(ValueError) as refused:
        parse_key_entries([f"acme:{good}", "beta:k3y9"])
    assert "#2" in str(refused.value) and good not in str(refused.value) and "k3y9" not in str(refused.value)


def test_presented_key_headers() -> None:
    assert presented_key({b"authorization": b"Bearer abc"}) == "abc"
    assert presented_key({b"authorization": b"bearer  abc "}) == "abc"
    assert presented_key({b"x-api-key": b"xyz"}) == "xyz"
    assert presented_key({b"authorization": b"Basic abc"}) is None
    assert presented_key({b"authorization": b"Bearer "}) is None
    assert presented_key({}) is None


def test_rate_limiter_token_bucket_with_a_fake_clock() -> None:
    now = [1000.0]
    limiter = RateLimiter(rate_per_minute=30, burst=3, clock=lambda: now[0])  # one token per 2 s
    for _ in range(3):
        limiter.check("k")
    with pytest.raises(RateLimited) as err:
        limiter.check("k")
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "2"
    limiter.check("other")  # separate budget
    now[0] += 1.0
    with pytest.raises(RateLimited) as err:
        limiter.check("k")
    assert err.value.headers["Retry-After"] == "1"
    now[0] += 1.0
    limiter.check("k")
    now[0] += 3600
    for _ in range(3):  # refills up to the burst, never beyond
        limiter.check("k")
    with pytest.raises(RateLimited):
        limiter.check("k")


def test_rate_limiter_forgets_quiet_clients() -> None:
    now = [0.0]
    limiter = RateLimiter(rate_per_minute=60, burst=2, clock=lambda: now[0])  # full again after 2 s
    limiter.max_tracked = 3
    for i in range(3):
        limiter.check(f"old-{i}")
    now[0] += 5
    limiter.check("new")  # the table passed its size: the quiet (full) buckets are dropped
    assert limiter.tracked() == 1


def test_engine_slots_and_job_quota() -> None:
    slots = EngineSlots(per_key=2)
    slots.acquire("a")
    with slots.hold("a"):
        with pytest.raises(RateLimited):
            slots.acquire("a")
        slots.acquire("b")
    assert slots.held("a") == 1 and slots.held("b") == 1
    slots.release("a")
    assert slots.held("a") == 0

    active = {1, 2}
    quota = JobQuota(per_key=2, still_active=lambda ids: {i for i in ids if i in active})
    assert quota.fits_without_lookup("k", adding=2)
    quota.record("k", [1, 2])
    assert not quota.fits_without_lookup("k")  # could be full: only `check` (with the lookup) can say
    assert quota.fits_without_lookup("other", adding=2)
    with pytest.raises(RateLimited) as err:
        quota.check("k")
    assert err.value.code == "too_many_jobs"
    quota.check("other")
    active.discard(1)  # job 1 finished somewhere
    quota.check("k")
    with pytest.raises(RateLimited):
        quota.check("k", adding=2)


def test_upload_memory_budget_caps_what_is_held() -> None:
    from api.uploads import MemoryBudget

    cap = random.randint(1000, 5000)
    budget = MemoryBudget(cap)
    first = random.randint(1, cap - 1)
    assert budget.take(first) and budget.used == first
    assert not budget.take(cap - first + 1) and budget.used == first  # a refusal takes nothing
    assert budget.take(cap - first) and budget.used == cap
    assert not budget.take(1)
    budget.give_back(cap)
    assert budget.used == 0 and budget.take(cap)


def test_api_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="burst"):
        ApiLimits(burst=0)


def test_cursor_round_trip_and_garbage() -> None:
    n = random.randrange(1, 10**9)
    assert decode_cursor(encode_cursor(n)) == n
    for bad in ("", "abc", encode_cursor(5)[:-1] + "!", base64.urlsafe_b64encode(b"x:1").decode()):
        with pytest.raises(ApiError) as err:
            decode_cursor(bad)
        assert err.value.code == "invalid_cursor"


def test_data_urls() -> None:
    payload = random.randbytes(50)
    url = "data:application/octet-stream;base64," + base64.b64encode(payload).decode()
    assert parse_data_url(url, 100).data == payload
    assert parse_data_url("data:,hello%20world", 100).data == b"hello world"
    with pytest.raises(DataUrlError) as too_large:
        parse_data_url(url, 49)
    assert too_large.value.reason == "too_large"
    budget = MediaBudget(max_parts=16, max_pixels=10**9)
    with pytest.raises(BodyTooLarge):
        decode_image(url, "image", 49, budget, 20.0)
    for bad, code in [("https://x/y.png", "remote_url_refused"), ("file:///etc/passwd", "remote_url_refused"),
                      ("data:image/png;base64", "invalid_media_url"),
                      ("data:image/png;base64,@@@", "invalid_media_url"),
                      ("javascript:alert(1)", "invalid_media_url")]:
        with pytest.raises(ApiError) as err:
            decode_image(bad, "image", 100, budget, 20.0)
        assert err.value.code == code, bad
    img = Image.new("RGB", (7, 5), (10, 20, 30))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    decoded = decode_image("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), "image", 10_000,
                           budget, 20.0)
    assert decoded.size == (7, 5) and decoded.getpixel((3, 2)) == (10, 20, 30)
    assert (budget.parts, budget.pixels) == (1, 35)  # charged from the header
    with pytest.raises(ApiError) as err:
        decode_image("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "image", 10_000, budget,
                     20.0)
    assert err.value.code == "invalid_image"


def test_serve_refuses_an_exposed_bind_without_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.10")
    check_bind("127.0.0.1", have_keys=False, insecure=False)
    check_bind("0.0.0.0", have_keys=True, insecure=False)
    check_bind("0.0.0.0", have_keys=False, insecure=True)
    with pytest.raises(BindRefused, match="DOCPIPE_API_KEYS"):
        check_bind("0.0.0.0", have_keys=False, insecure=False)
    # Through the CLI entry point, as `docpipe serve` (it exits before building the app).
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """docpipe"""

    register(app)
    monkeypatch.setenv("DOCPIPE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("DOCPIPE_API_KEYS", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "refusing to serve on 0.0.0.0" in result.output
