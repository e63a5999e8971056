"""A mergeable quantile sketch: DDSketch's logarithmic buckets, kept as counts per bucket.

A value ``v > 0`` goes into bucket ``ceil(log(v) / log(GAMMA))``; every value in a bucket is within
RELATIVE_ACCURACY of the bucket's representative, so any quantile read back is within 1% of the exact
one (Masson, Rim and Lee, "DDSketch", VLDB 2019). Sketches of blocks of steps merge by adding counts,
so a run's median over a million steps is read from a few thousand small blobs, never from the rows.

The writer adds values one at a time (``Sketch.add``, on its own thread); readers decode many blobs at
once with numpy (``quantiles``). A blob is little-endian int32 pairs: bucket, count; bucket ZERO_BUCKET
counts zeros (and the rare negative duration a clock step can give).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

__all__ = ["RELATIVE_ACCURACY", "GAMMA", "ZERO_BUCKET", "Sketch", "bucket", "decode", "quantiles", "grouped_quantile"]

RELATIVE_ACCURACY = 0.01  # a quantile read back is within 1% of the exact one
GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
_LOG_GAMMA = math.log(GAMMA)
ZERO_BUCKET = -(2**31)  # counts values <= MIN_VALUE
MIN_VALUE = 1e-9  # 1 femtosecond in ms, 1e-9 bytes: below anything dpprof measures
_PAIR = np.dtype([("bucket", "<i4"), ("count", "<i4")])


def bucket(value: float) -> int:
    """The bucket ``value`` counts in: a value that goes into several sketches is bucketed once."""
    return math.ceil(math.log(value) / _LOG_GAMMA) if value > MIN_VALUE else ZERO_BUCKET


class Sketch:
    """Counts per logarithmic bucket of the values added (see the module's docstring)."""

    __slots__ = ("counts",)

    def __init__(self, counts: dict[int, int] | None = None) -> None:
        self.counts: dict[int, int] = counts if counts is not None else {}

    def add(self, value: float) -> None:
        self.add_bucket(bucket(value))

    def add_bucket(self, key: int) -> None:
        """Count one value already bucketed (``bucket(value)``)."""
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1

    def merge(self, other: Sketch) -> None:
        counts = self.counts
        for key, n in other.counts.items():
            counts[key] = counts.get(key, 0) + n

    def to_bytes(self) -> bytes:
        pairs = np.fromiter(self.counts.items(), dtype=_PAIR, count=len(self.counts))
        return pairs.tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes | None) -> Sketch:
        if not blob:
            return cls()
        pairs = np.frombuffer(blob, dtype=_PAIR)
        return cls(dict(zip(pairs["bucket"].tolist(), pairs["count"].tolist())))

    def quantile(self, q: float) -> float:
        return quantiles([self.to_bytes()], (q,))[0]


def decode(blobs: Iterable[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    """(buckets, counts) of the merged sketches ``blobs``: bucket keys sorted, their summed counts."""
    joined = b"".join(b for b in blobs if b)
    if not joined:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    pairs = np.frombuffer(joined, dtype=_PAIR)
    keys, counts = pairs["bucket"].astype(np.int64), pairs["count"].astype(np.int64)
    zero = keys == ZERO_BUCKET
    zeros = int(counts[zero].sum())
    keys, counts = keys[~zero], counts[~zero]
    out_keys, out_counts = [], []
    if zeros:
        out_keys.append(np.array([ZERO_BUCKET], dtype=np.int64))
        out_counts.append(np.array([zeros], dtype=np.int64))
    if len(keys):  # buckets span a few hundred keys: count them densely, no sort
        low = int(keys.min())
        dense = np.bincount(keys - low, weights=counts).astype(np.int64)
        present = np.flatnonzero(dense)
        out_keys.append(present + low)
        out_counts.append(dense[present])
    return np.concatenate(out_keys), np.concatenate(out_counts)


def _value(key: int) -> float:
    """The representative of a bucket: within RELATIVE_ACCURACY of every value in it."""
    if key == ZERO_BUCKET:
        return 0.0
    return 2 * GAMMA**key / (GAMMA + 1)


def quantiles(blobs: Iterable[bytes | None], qs: Iterable[float]) -> list[float]:
    """The quantiles ``qs`` (0..1) of all the values of the merged sketches; NaN when they hold none.

    A quantile is the value of rank ``q * (n - 1)`` (numpy's "lower" rule), read within 1%.
    """
    keys, counts = decode(blobs)
    qs = list(qs)
    if not len(counts):
        return [float("nan")] * len(qs)
    cumulative = np.cumsum(counts)
    n = int(cumulative[-1])
    out = []
    for q in qs:
        rank = int(math.floor(min(max(q, 0.0), 1.0) * (n - 1)))
        out.append(_value(int(keys[np.searchsorted(cumulative, rank, side="right")])))
    return out


def grouped_quantile(blobs: list[bytes | None], groups: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    """The quantile ``q`` of each group's merged sketches at once (a band's median per bucket of blocks).

    Args:
        blobs: one sketch per row; groups: each row's group (integers).

    Returns:
        (the groups that hold values, sorted; their quantiles), read as ``quantiles`` reads them.
    """
    sizes = np.fromiter((len(b) // _PAIR.itemsize if b else 0 for b in blobs), dtype=np.int64, count=len(blobs))
    if not sizes.sum():
        return np.empty(0, dtype=np.int64), np.empty(0)
    pairs = np.frombuffer(b"".join(b for b in blobs if b), dtype=_PAIR)
    group = np.repeat(np.asarray(groups, dtype=np.int64), sizes)
    order = np.lexsort((pairs["bucket"], group))
    group, keys, counts = group[order], pairs["bucket"][order].astype(np.int64), pairs["count"][order].astype(np.int64)
    found, start = np.unique(group, return_index=True)
    ends = np.append(start[1:], len(group))
    cumulative = np.cumsum(counts)
    before = cumulative[start] - counts[start]
    within = cumulative - np.repeat(before, ends - start)  # counts so far inside each group
    totals = cumulative[ends - 1] - before
    rank = np.floor(min(max(q, 0.0), 1.0) * (totals - 1)).astype(np.int64)
    hits = np.flatnonzero(within > np.repeat(rank, ends - start))
    chosen = keys[hits[np.searchsorted(hits, start)]]
    values = np.where(chosen == ZERO_BUCKET, 0.0, 2 * GAMMA ** chosen.astype(float) / (GAMMA + 1))
    return found, values
