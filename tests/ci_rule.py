"""The one rule for what a missing service or test dependency means: a skip on a developer's machine (printed, so
the run says why), a failure under CI. Every tests/*/conftest.py, apitest_support.py and the parity modules use
it, so the rule cannot drift between suites.

CI counts as on when the CI variable is `1`, `true` or `yes` (any case): the values CI systems set.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

CI_ON = frozenset({"1", "true", "yes"})


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in CI_ON


def missing(reason: str) -> NoReturn:
    """Something this test needs is not there: fail under CI, else print why and skip."""
    if on_ci():
        pytest.fail(f"{reason} (CI is set: this is required)", pytrace=False)
    print(f"SKIP: {reason}")
    pytest.skip(reason)


def require_module(name: str, why: str = "a test dependency (the [test] extra)") -> ModuleType:
    """`pytest.importorskip` that fails under CI: a missing test dependency is as wrong there as a missing
    service. Usable at module level (the whole module is skipped, or fails to collect under CI)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if on_ci():
            raise pytest.fail.Exception(f"{name} is not importable ({exc}); it is {why}, required under CI",
                                        pytrace=False) from exc
        print(f"SKIP: {name} is not importable ({exc})")
        raise pytest.skip.Exception(f"{name} is not importable: {exc}", allow_module_level=True) from exc
