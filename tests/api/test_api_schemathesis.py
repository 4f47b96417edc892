"""Property-based requests generated from the app's own OpenAPI document (schemathesis) over real HTTP: no 5xx."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from apitest_support import KEY, LiveServer, live_server, test_settings
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(test_settings(tmp_path_factory.mktemp("api-fuzz"))) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(fuzz_server: LiveServer):
    return schemathesis.openapi.from_url(fuzz_server.base + "/openapi.json", headers={"X-API-Key": KEY}, timeout=30)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_server: LiveServer) -> None:
    case.call_and_validate(base_url=fuzz_server.base, headers={"X-API-Key": KEY}, checks=[not_a_server_error],
                           timeout=60)
