"""Grammar-forced (jump-forward) runs of a decoding sequence, cut to the longest chunk the runner keeps on its
decode kernels.

After a sampled token the grammar may force a run of tokens (structured.py); the scheduler computes a decoding
sequence's uncomputed tokens as one chunk. A runner whose decode kernels take chunks of at most some length (the
CUDA runner: past decode_graphs.GRAPH_MAX_CHUNK a step leaves its graphs, and at text_model.FLASH_MIN_CHUNK its
attention switches to the prefill kernel for the whole step) declares it as `max_decode_chunk_tokens`; such a run
is then computed over several steps, at most that many tokens a step. Forced tokens are already chosen, so this
changes when they are computed, never what comes out. Prompt chunks and verify windows are never cut here.
"""
from __future__ import annotations

from typing import Any

from .errors import RunnerInputError
from .sequence import Sequence

CAPABILITY = "max_decode_chunk_tokens"  # optional runner attribute (runner_api.Runner): int >= 1, or absent / None


def decode_chunk_limit(runner: Any) -> int | None:
    """The runner's declared longest decode-phase chunk, or None (no limit: runs are computed whole)."""
    value = getattr(runner, CAPABILITY, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RunnerInputError(f"runner {getattr(runner, 'name', '?')!r}: {CAPABILITY} must be an int >= 1 or "
                               f"None, got {value!r}")
    return value


def decode_chunk(seq: Sequence, n: int, limit: int | None) -> int:
    """Tokens of decoding sequence `seq` to run this step, of the `n` the budget allows: a forced run is cut to
    `limit`; a verify window (drafts after the last real token) runs whole, since it is verified as one."""
    if limit is None or seq.num_drafts:
        return n
    return min(n, limit)
