"""Run ids: how recorded runs and imported traces name their files."""
from __future__ import annotations

import uuid
from datetime import datetime, timezone

__all__ = ["new_run_id"]


def new_run_id(now: datetime | None = None) -> str:
    """A run id: UTC time to the second and six random hex digits (sortable, unique across processes)."""
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
