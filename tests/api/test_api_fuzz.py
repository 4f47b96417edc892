"""Our own fuzzing (hypothesis) of every route that takes client text or numbers, over real HTTP against SQLite and
PostgreSQL: NUL and other control characters, lone surrogates, huge and negative integers, non-finite floats,
deeply nested JSON and long multipart boundaries. Whatever the input, the answer is never a 5xx, and a 4xx is a
problem document with a stable code.

Schemathesis (test_api_schemathesis.py) generates values from the OpenAPI document, so it stays inside what the
spec describes; these strategies aim at what the database, the parsers and the engine cannot take.
"""
from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from apitest_support import LiveServer, server  # noqa: F401 (fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=30, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# --- strategies -------------------------------------------------------------------------------------------------

SPECIAL_TEXT = ["\x00", "a\x00b", "\x00" * 70, "\ud800", "x\udfff", "%00", "\x1b[31m", "\u202e", "\r\n", "../..",
                "generic", "generic\x00", " ", "😀" * 40, "a" * 300, "'; DROP TABLE schemas; --"]
controls = st.characters(min_codepoint=0, max_codepoint=0x1F)
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
nasty_text = st.one_of(
    st.sampled_from(SPECIAL_TEXT),
    st.text(st.one_of(controls, surrogates, st.characters()), max_size=80),
)
# In a URL a lone surrogate has no UTF-8 form (the client cannot send one): there, it stands for U+FFFD.
url_text = nasty_text.map(lambda s: s.encode("utf-8", "replace").decode("utf-8", "replace"))
huge_int = st.one_of(
    st.integers(min_value=-5, max_value=5),
    st.integers(min_value=2**31 - 3, max_value=2**31 + 3),
    st.integers(min_value=2**63 - 3, max_value=2**64 + 3),
    st.integers(min_value=-(2**64), max_value=-(2**31)),
    st.sampled_from([10**30, -(10**30), 10**300]),
)
any_number = st.one_of(huge_int, st.floats(allow_nan=True, allow_infinity=True))


@dataclass(frozen=True)
class Deep:
    """JSON nested `depth` levels, written out as text when the body is encoded: Python's own JSON encoder (and
    hypothesis' printer) would recurse past the interpreter's limit on the deepest ones."""

    depth: int
    kind: str  # "schema": objects in properties; "list": arrays

    def text(self) -> str:
        if self.kind == "schema":
            return '{"type": "object", "properties": {"a": ' * self.depth + '{"type": "string"}' + "}}" * self.depth
        return "[" * self.depth + "1" + "]" * self.depth


# Around the budget's 64 levels, past Python's recursion limit in jsonschema (~100 schema levels) and past what
# the JSON parser itself takes (~1000 levels).
depths = st.one_of(st.sampled_from([1, 31, 32, 33, 63, 64, 65]), st.integers(66, 450), st.sampled_from([2000, 100_000]))
deep_schema = st.builds(Deep, depths, st.just("schema"))
deep_json = st.one_of(deep_schema, st.builds(Deep, depths, st.just("list")))
json_scalar = st.one_of(st.none(), st.booleans(), any_number, nasty_text)
json_value = st.recursive(json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(nasty_text, inner, max_size=4)),
                          max_leaves=12)
schema_like = st.one_of(
    deep_schema,
    deep_json,
    st.dictionaries(nasty_text, json_value, max_size=4),
    st.fixed_dictionaries({"type": st.just("object"),
                           "properties": st.dictionaries(nasty_text, st.one_of(deep_json, json_value), max_size=3)}),
)
boundary = st.one_of(
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters='"\\;,'), min_size=1,
            max_size=90),
    st.integers(min_value=60, max_value=100_000).map(lambda n: "b" * n),
)


def json_body(value: Any) -> bytes:
    """Python's JSON: lone surrogates go out as \\ud800 escapes, NaN and Infinity as the literals Python's (and
    Starlette's) parser accepts; Deep values are spliced in as text."""
    deep: dict[str, Deep] = {}

    def mark(obj: Any) -> str:
        if not isinstance(obj, Deep):
            raise TypeError(f"not JSON: {obj!r}")
        key = f"@@deep{len(deep)}@@"
        deep[key] = obj
        return key

    text = json.dumps(value, allow_nan=True, default=mark)
    for key, obj in deep.items():
        text = text.replace(json.dumps(key), obj.text())
    return text.encode()


# uvicorn's own answer to a request head it will not buffer (h11 keeps at most 16 KiB of an incomplete head): a
# 400 before any of our code runs, so it cannot be a problem document.
SERVER_REFUSED_HEAD = "Invalid HTTP request received."


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, f"{response.request.method} {response.request.url}: {response.text}"
    if response.status_code == 400 and response.text == SERVER_REFUSED_HEAD:
        return
    if response.status_code >= 400:
        assert response.headers["content-type"].startswith("application/problem+json"), response.text
        assert isinstance(response.json()["code"], str)


@pytest.fixture(scope="module")
def c(server: LiveServer) -> Any:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def model_id(c: httpx.Client) -> str:
    return str(c.get("/v1/models").json()["data"][0]["id"])


# --- the routes -------------------------------------------------------------------------------------------------


@FUZZ
@given(status=url_text, schema=url_text, after=url_text, limit=huge_int,
       cursor=st.one_of(url_text, huge_int.map(lambda n: base64.urlsafe_b64encode(f"d:{n}".encode()).decode())))
def test_document_list(c: httpx.Client, status: str, schema: str, after: str, limit: int, cursor: str) -> None:
    check(c.get("/v1/documents", params={"schema": schema, "limit": limit, "cursor": cursor}))
    check(c.get("/v1/documents", params={"status": status, "created_after": after, "created_before": after}))


@FUZZ
@given(doc_id=st.one_of(huge_int, url_text), index=st.one_of(huge_int, url_text), schema=url_text)
def test_document_routes_by_id(c: httpx.Client, doc_id: object, index: object, schema: str) -> None:
    ident = quote(str(doc_id), safe="")
    check(c.get(f"/v1/documents/{ident}"))
    check(c.get(f"/v1/documents/{ident}/result", params={"schema": schema}))
    check(c.get(f"/v1/documents/{ident}/pages/{quote(str(index), safe='')}.png"))
    check(c.delete(f"/v1/documents/{ident}"))


@FUZZ
@given(job_id=st.one_of(huge_int, url_text), batch_id=st.one_of(huge_int, url_text))
def test_job_and_batch_routes_by_id(c: httpx.Client, job_id: object, batch_id: object) -> None:
    check(c.get(f"/v1/jobs/{quote(str(job_id), safe='')}"))
    check(c.post(f"/v1/jobs/{quote(str(job_id), safe='')}/retry"))
    check(c.get(f"/v1/batches/{quote(str(batch_id), safe='')}"))


@FUZZ
@given(name=url_text, version=st.one_of(huge_int, url_text))
def test_schema_lookup(c: httpx.Client, name: str, version: object) -> None:
    check(c.get(f"/v1/schemas/{quote(name, safe='')}"))
    check(c.get(f"/v1/schemas/{quote(name, safe='')}", params={"version": str(version)}))


@FUZZ
@given(name=st.one_of(nasty_text, st.from_regex(r"\A[a-z][a-z0-9_-]{0,20}\Z")), prompt=st.none() | nasty_text,
       json_schema=schema_like, merge_rules=st.none() | st.dictionaries(nasty_text, nasty_text, max_size=3))
def test_schema_registration(c: httpx.Client, name: str, prompt: str | None, json_schema: Any,
                             merge_rules: dict[str, str] | None) -> None:
    body = {"name": name, "prompt": prompt, "json_schema": json_schema, "merge_rules": merge_rules}
    check(c.post("/v1/schemas", content=json_body(body), headers={"Content-Type": "application/json"}))


def _multipart(bnd: str, parts: list[tuple[str, str | None, bytes]]) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--{bnd}\r\nContent-Disposition: {disposition}\r\n\r\n".encode("utf-8", "surrogateescape")
        out += data + b"\r\n"
    return out + f"--{bnd}--\r\n".encode()


@FUZZ
@given(bnd=boundary, filename=url_text, schema=url_text, password=st.none() | url_text,
       route=st.sampled_from(["/v1/documents", "/v1/batches"]))
def test_uploads(c: httpx.Client, bnd: str, filename: str, schema: str, password: str | None, route: str) -> None:
    # Junk bytes (no job is queued for them, the document is kept `failed`): the request's own handling is fuzzed,
    # not the model.
    junk = b"not a document " + random.randbytes(16)
    parts: list[tuple[str, str | None, bytes]] = [("file" if route == "/v1/documents" else "files", filename, junk),
                                                  ("schema", None, schema.encode())]
    if password is not None:
        parts.append(("password", None, password.encode()))
    check(c.post(route, content=_multipart(bnd, parts),
                 headers={"Content-Type": f"multipart/form-data; boundary={bnd}"}))


def _chat(c: httpx.Client, model_id: str, **fields: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": model_id, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2,
                            **fields}
    return c.post("/v1/chat/completions", content=json_body(body), headers={"Content-Type": "application/json"})


# One field fuzzed at a time, the others valid: a request with several bad fields stops at the first check, so
# fuzzing them all at once would rarely reach the later ones (the seed, the schema).
CHAT_NUMBERS = ["seed", "max_tokens", "max_completion_tokens", "temperature", "top_p", "presence_penalty", "n",
                "top_logprobs"]


@FUZZ
@given(field=st.sampled_from(CHAT_NUMBERS), value=any_number)
def test_chat_numbers(c: httpx.Client, model_id: str, field: str, value: float) -> None:
    check(_chat(c, model_id, **{field: value}))


@FUZZ
@given(text=nasty_text, stop=st.none() | nasty_text | st.lists(nasty_text, max_size=3), role=st.sampled_from(
    ["user", "system", "developer", "assistant"]))
def test_chat_text(c: httpx.Client, model_id: str, text: str, stop: Any, role: str) -> None:
    messages = [{"role": role, "content": text}, {"role": "user", "content": [{"type": "text", "text": text}]}]
    check(_chat(c, model_id, messages=messages, **({} if stop is None else {"stop": stop})))


@FUZZ
@given(response_schema=schema_like, name=nasty_text)
def test_chat_response_format(c: httpx.Client, model_id: str, response_schema: Any, name: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": name[:64], "schema": response_schema}}
    check(_chat(c, model_id, response_format=fmt))


@FUZZ
@given(key=st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=300),
       header=st.sampled_from(["X-API-Key", "Authorization"]))
def test_api_key_headers(server: LiveServer, key: str, header: str) -> None:
    # Header values travel as latin-1 text; NUL, line breaks and leading or trailing blanks cannot (the client and
    # h11 refuse them).
    value = (key.strip(" \t") or "x").encode("latin-1")
    with httpx.Client(base_url=server.base, headers={header: value}, timeout=60) as anon:
        check(anon.get("/v1/documents"))
