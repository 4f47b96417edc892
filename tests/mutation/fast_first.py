"""pytest plugin for the mutation pass only: run.sh installs it as the private copy's root conftest.py.

mutmut runs, with -x, every selected test that calls the mutated function, in no particular order. The direct
tests go first, so a mutant they kill costs milliseconds, not the seconds of the pipeline tests that also reach
the function: first the test files named after the mutated module (`test_merge_rules.py` for
`pipeline.merge.…`, `test_vision_sniff.py` for `vision.sniff.…`), then the other `*_rules.py` files, then the
rest in pytest's order. mutmut names the mutant under test in MUTANT_UNDER_TEST (absent in the clean runs).
"""
from __future__ import annotations

import os

import pytest


def _rank(item: pytest.Item, module: str) -> int:
    name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if module and module in name:
        return 0
    return 1 if name.endswith("_rules.py") else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    parts = os.environ.get("MUTANT_UNDER_TEST", "").split(".")
    module = parts[1] if len(parts) > 2 else ""  # "pipeline.merge.x_merge_units__mutmut_3" -> "merge"
    items.sort(key=lambda item: _rank(item, module))  # stable: each group keeps pytest's order
