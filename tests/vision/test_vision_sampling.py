"""Frame plans: `RenderOptions.frame_sampler` chooses a video's frames (vision holds no sampling rule of its own),
and `pad_indices` pads the plan to whole temporal patches."""

from __future__ import annotations

import numpy as np

from vision import pad_indices


def test_padding_repeats_the_last_index():
    rng = np.random.default_rng()
    for _ in range(50):
        indices = sorted(int(i) for i in rng.integers(0, 1000, int(rng.integers(1, 30))))
        for multiple in (1, 2, 3):
            padded = pad_indices(indices, multiple)
            assert len(padded) % multiple == 0 and len(padded) - len(indices) < multiple
            assert padded[: len(indices)] == indices
            assert set(padded[len(indices):]) <= {indices[-1]}
