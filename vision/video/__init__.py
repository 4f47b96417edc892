"""Video input: probe, the caller's frame plan, isolated decoding, optional near-duplicate removal."""

from .document import VideoDocument
from .sampling import pad_indices

__all__ = ["VideoDocument", "pad_indices"]
