"""Video input: probe, Qwen frame sampling, isolated decoding, optional near-duplicate removal."""

from .document import VideoDocument
from .sampling import pad_indices, qwen_frame_indices

__all__ = ["VideoDocument", "pad_indices", "qwen_frame_indices"]
