"""Shared fixture of the vision tests: a fresh random generator per test (fresh inputs every run)."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()
