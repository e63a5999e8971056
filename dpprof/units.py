"""Units as people read them: bytes in KiB, MiB or GiB by size. Shared by findings, views and charts."""
from __future__ import annotations

__all__ = ["mib", "bytes_unit", "plural", "steps_words"]


def mib(value: float) -> str:
    """Bytes in words: "48 B" under one KiB, "512.0 KiB" under one MiB, "12.3 MiB", "1.50 GiB" from one GiB."""
    if value >= 2**30:
        return f"{value / 2**30:,.2f} GiB"
    if value >= 2**20:
        return f"{value / 2**20:,.1f} MiB"
    return f"{value / 2**10:,.1f} KiB" if value >= 2**10 else f"{value:,.0f} B"


def bytes_unit(max_bytes: float) -> tuple[str, float]:
    """The unit a byte axis reads best in, and its scale: KiB under one MiB, GiB from one GiB, else MiB."""
    if max_bytes >= 2**30:
        return "GiB", 2**-30
    if 0 < max_bytes < 2**20:
        return "KiB", 2**-10
    return "MiB", 2**-20


def plural(count: int, noun: str) -> str:
    """A count and its noun, singular for one: "1 step", "2 steps", "1,000 steps"."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def steps_words(first_step: int, end_step: int) -> str:
    """Steps ``first_step`` to ``end_step - 1`` in words: "steps 2 to 3", "step 4" for one."""
    last = end_step - 1
    return f"step {first_step}" if last == first_step else f"steps {first_step} to {last}"
