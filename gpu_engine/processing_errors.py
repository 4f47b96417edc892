"""The one error type of prompt building: bad media or messages, or processor configs that cannot work."""
from __future__ import annotations

from .errors import InvalidRequestError


class ProcessorError(InvalidRequestError, ValueError):
    """Bad media or messages, or processor configs that cannot work; the message says which input and why."""
