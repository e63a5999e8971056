"""dpprof.store.sketch: quantiles within 1% of the exact ones, and merges that equal one sketch of all values."""
from __future__ import annotations

import numpy as np
import pytest

from dpprof.store.sketch import RELATIVE_ACCURACY, Sketch, bucket, quantiles


def _sketch(values) -> Sketch:
    s = Sketch()
    for v in values:
        s.add(float(v))
    return s


@pytest.mark.parametrize("values", [
    np.random.default_rng(0).lognormal(0.0, 0.3, 5_000),  # step times: a spread around a median
    np.random.default_rng(1).exponential(2.0, 3_000) + 0.01,  # a long tail
    np.linspace(0.001, 1_000.0, 2_001),  # six decades
])
@pytest.mark.parametrize("q", [0.0, 0.05, 0.5, 0.95, 1.0])
def test_a_quantile_is_within_the_relative_accuracy_of_the_exact_one(values, q):
    exact = float(np.quantile(values, q, method="lower"))
    got = _sketch(values).quantile(q)
    assert abs(got - exact) <= RELATIVE_ACCURACY * exact * (1 + 1e-9)


def test_sketches_merge_by_their_blobs_as_one_sketch_of_every_value():
    rng = np.random.default_rng(2)
    parts = [rng.lognormal(1.0, 0.5, n) for n in (10, 300, 7, 1_000)]
    whole = _sketch(np.concatenate(parts))
    blobs = [_sketch(p).to_bytes() for p in parts]
    qs = (0.1, 0.5, 0.9, 0.99)
    assert quantiles(blobs, qs) == quantiles([whole.to_bytes()], qs)
    assert quantiles([b"".join(blobs)], qs) == quantiles(blobs, qs)  # concatenated blobs (a merge in SQL) too
    merged = Sketch()
    for b in blobs:
        merged.merge(Sketch.from_bytes(b))
    assert merged.counts == whole.counts


def test_zeros_and_no_values():
    assert _sketch([0.0, 0.0, 5.0]).quantile(0.5) == 0.0
    assert np.isnan(quantiles([None, b""], (0.5,))[0])


def test_a_value_bucketed_once_counts_as_adding_it():
    """The writer buckets a step's duration once for the three sketches it goes into (Sketch.add_bucket)."""
    values = [0.0, -1e-3, 1e-12, 1e-9, 0.5, 1.0, 7.25, 1e6, *np.random.default_rng(3).lognormal(0.0, 2.0, 500)]
    added, bucketed = Sketch(), Sketch()
    for v in values:
        added.add(float(v))
        bucketed.add_bucket(bucket(float(v)))
    assert bucketed.counts == added.counts
