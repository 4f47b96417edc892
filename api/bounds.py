"""The ranges client integers must fall in: what the database columns and the engine can hold.

Checked where the value enters (path and query parameters, cursors, request bodies), so a number out of range is a
4xx naming the range rather than an overflow in the database driver or the engine.
"""
from __future__ import annotations

MAX_ROW_ID = 2**31 - 1  # row ids are 32-bit integers in PostgreSQL: larger numbers cannot name anything
MAX_PAGE_INDEX = 1_000_000  # pages (or sampled video frames) of one document, counted from 0
MAX_SEED = 2**63 - 1  # the engine seeds numpy with a non-negative int64 (it draws its own seeds from [0, 2**63))
