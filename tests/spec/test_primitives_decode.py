"""The decode-attention workload generators: a batch's KV lengths and a paged cache's block
table."""

import pytest

from tileops.spec.primitives import PrimitiveError, kv_lengths, page_table


def test_kv_lengths_step_down_to_zero():
    assert kv_lengths(12, 301, 30) == [301, 271, 241, 211, 181, 151, 121, 91, 61, 31, 1, 0]
    assert kv_lengths(3, 8192, 0) == [8192, 8192, 8192]
    assert kv_lengths(0, 5, 1) == []


def test_kv_lengths_refuses_negative_values():
    with pytest.raises(PrimitiveError) as exc:
        kv_lengths(2, -1, 3)
    assert str(exc.value) == "kv_lengths needs longest >= 0 and step >= 0, got -1 and 3"


@pytest.mark.parametrize("n, pages, pool", [(13, 20, 260), (64, 128, 8192), (3, 1, 3),
                                            (1, 1, 1), (2, 3, 7)])
def test_page_table_scatters_distinct_pages_over_a_large_enough_pool(n, pages, pool):
    table = page_table(n, pages, pool)
    assert len(table) == n * pages
    assert all(0 <= p < pool for p in table)
    assert len(set(table)) == n * pages  # distinct: n * pages <= pool
    if n * pages > 2:
        assert table != sorted(table)  # scattered, not the pool in order


def test_page_table_shares_a_small_pool():
    table = page_table(8, 16, 12)
    assert all(0 <= p < 12 for p in table) and set(table) == set(range(12))


def test_page_table_refuses_an_empty_pool():
    with pytest.raises(PrimitiveError) as exc:
        page_table(2, 3, 0)
    assert str(exc.value) == "page_table needs pool > 0, got 0"
