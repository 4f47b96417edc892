"""REST routes, one module per resource."""
from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

# Row ids are 32-bit integers in PostgreSQL: larger numbers cannot name anything, so they are refused up front
# (422) instead of reaching the database driver.
MAX_ID = 2**31 - 1
RowId = Annotated[int, Path(ge=1, le=MAX_ID, description="Row id")]
Version = Annotated[int | None, Query(ge=1, le=MAX_ID)]
