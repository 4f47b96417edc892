"""Speculative decoding: drafters (prompt lookup, the checkpoint's MTP head) propose tokens after each decoding
sequence's last token; the target verifies them in one window per sequence, and what it rejects is rolled back
(speculator.py has the flow, rejection.py the sampling rule, config.py the knobs and the cost rule)."""
from .config import METHODS, SpeculativeConfig, SpeculativeConfigError
from .speculator import Speculator

__all__ = ["METHODS", "SpeculativeConfig", "SpeculativeConfigError", "Speculator"]
