import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.trainer.balance import balanced_order, imbalance


def test_balances_a_skewed_batch():
    lengths = torch.tensor([100, 100, 100, 100, 10, 10, 10, 10])
    assert imbalance(lengths, 2) > 1.5
    order = balanced_order(lengths, 2)
    assert imbalance(lengths[order], 2) == 1.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=40), st.integers(1, 4))
def test_is_a_permutation_with_equal_counts_within_the_greedy_bound(raw, world):
    n = len(raw) - len(raw) % world or len(raw)
    lengths = torch.tensor(raw[:n])
    order = balanced_order(lengths, world)
    assert sorted(order.tolist()) == list(range(n))
    if n % world == 0:
        # longest-first greedy is within 4/3 of the best split; the given order is no better than the best
        assert imbalance(lengths[order], world) <= 4 / 3 * imbalance(lengths, world) + 1e-6
