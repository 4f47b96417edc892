"""Raw config.json dictionaries for the ModelConfig tests: a base checkpoint config with text_config keys changed."""
from __future__ import annotations

import copy
from typing import Any


def text_variant(base: dict[str, Any], **text_changes: Any) -> dict[str, Any]:
    """A deep copy of `base` with each of `text_changes` set in its text_config (a value of None removes the key)."""
    raw = copy.deepcopy(base)
    text = raw["text_config"]
    for key, value in text_changes.items():
        if value is None:
            text.pop(key, None)
        else:
            text[key] = value
    return raw
