"""pytest plugin for the mutation pass only: run.sh installs it as the private copy's root conftest.py.

mutmut runs, with -x, every selected test that calls the mutated function, in no particular order. The direct
tests (`*_rules.py`, milliseconds each) go first, so a mutant they kill costs milliseconds, not the seconds of the
pipeline tests that also reach the function. Otherwise the order is pytest's.
"""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: 0 if "_rules.py::" in item.nodeid else 1)  # stable: the rest keep their order
