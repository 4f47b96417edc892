"""Puts bench/ on sys.path before any test module here is imported (import sorting may place a bench script's
import above the modules' own `from tests.bench import _paths`)."""
from tests.bench import _paths  # noqa: F401  (imported for its sys.path side effect)
