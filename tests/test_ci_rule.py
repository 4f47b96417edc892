"""The shared CI rule (tests/ci_rule.py): which CI values count, and what a missing service or module becomes."""
from __future__ import annotations

import ci_rule
import pytest


@pytest.mark.parametrize("value, on", [("true", True), ("1", True), ("yes", True), ("TRUE", True), ("Yes", True),
                                       ("", False), ("0", False), ("false", False), ("no", False)])
def test_ci_values(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv("CI", value)
    assert ci_rule.on_ci() is on


def test_ci_unset_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert ci_rule.on_ci() is False


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_a_missing_service_fails_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="Redis is gone"):
        ci_rule.missing("Redis is gone")


def test_a_missing_service_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Redis is gone"):
        ci_rule.missing("Redis is gone")


def test_a_missing_module_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "yes")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_docpipe"):
        ci_rule.require_module("no_such_module_docpipe")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="no_such_module_docpipe"):
        ci_rule.require_module("no_such_module_docpipe")


def test_a_present_module_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    import json

    assert ci_rule.require_module("json") is json
