"""REST routes, one module per resource."""
from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from ..bounds import MAX_PAGE_INDEX, MAX_ROW_ID

# Refused up front (422) instead of reaching the database driver as numbers no column can hold.
RowId = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="Row id")]
Version = Annotated[int | None, Query(ge=1, le=MAX_ROW_ID)]
PageIndex = Annotated[int, Path(ge=0, le=MAX_PAGE_INDEX, description="Page or video frame, counted from 0")]
