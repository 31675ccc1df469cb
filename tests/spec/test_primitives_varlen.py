"""scaled_prefix_sum: the offsets of packed sequences that a scaled-down workload row keeps
within its tensor."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tileops.spec.primitives import GENERATORS, PrimitiveError, prefix_sum, scaled_prefix_sum


def test_at_the_lengths_sum_it_is_the_prefix_sum():
    assert scaled_prefix_sum([32, 0, 4096, 1000], 5128) == prefix_sum([32, 0, 4096, 1000])
    assert GENERATORS["scaled_prefix_sum"].impl is scaled_prefix_sum


def test_a_smaller_total_scales_every_offset_and_keeps_empty_sequences_empty():
    assert scaled_prefix_sum([100, 0, 300], 40) == [0, 10, 10, 40]
    assert scaled_prefix_sum([], 0) == [0]
    assert scaled_prefix_sum([0, 0], 0) == [0, 0, 0]


@given(xs=st.lists(st.integers(0, 5000), min_size=1, max_size=40),
       frac=st.floats(0.0, 1.0))
def test_offsets_rise_from_zero_to_the_total(xs, frac):
    total = int(sum(xs) * frac)
    if sum(xs) == 0:
        total = 0
    out = scaled_prefix_sum(xs, total)
    assert len(out) == len(xs) + 1 and out[0] == 0 and out[-1] == total
    steps = list(zip(out[:-1], out[1:], xs, strict=True))
    assert all(a <= b <= a + x for a, b, x in steps)  # rising; no sequence grows
    assert all(b == a for a, b, x in steps if x == 0)


@pytest.mark.parametrize(("xs", "total", "text"), [
    ([1, -1], 2, "scaled_prefix_sum needs lengths and a total >= 0, got [1, -1] and 2"),
    ([3], -1, "scaled_prefix_sum needs lengths and a total >= 0, got [3] and -1"),
    ([0, 0], 5, "scaled_prefix_sum cannot fill 5 items with sequences of no length"),
])
def test_bad_arguments_are_refused_by_name(xs, total, text):
    with pytest.raises(PrimitiveError) as exc:
        scaled_prefix_sum(xs, total)
    assert str(exc.value) == text
