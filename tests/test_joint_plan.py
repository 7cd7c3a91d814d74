"""The KV plan's choice of one action per layer (hfcompress/keys/joint.py): keep, low-rank keys at a width, or drop."""

import itertools
import random

import pytest

from hfcompress.keys.joint import Option, plan_layers


def brute_force(menus: dict[int, list[Option]], budget: float) -> float:
    """The least summed cost (negative costs as zero) of any choice within the budget."""
    best = float("inf")
    for choice in itertools.product(*menus.values()):
        if sum(o.values for o in choice) <= budget:
            best = min(best, sum(max(o.cost, 0.0) for o in choice))
    return best


def random_menus(rng: random.Random, layers: int) -> dict[int, list[Option]]:
    menus = {}
    for layer in range(layers):
        menu = [Option("keep", 48, 0.0)]
        menu += [Option("keys", 24 + n, rng.uniform(-0.01, 0.3) * (24 - n) / 24, n) for n in (8, 16)]
        menus[layer] = menu + [Option("drop", 0, rng.uniform(0.0, 1.0))]
    return menus


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_the_least_cost_choice_within_the_budget(seed):
    rng = random.Random(seed)
    menus = random_menus(rng, 5)
    budget = rng.uniform(0.2, 1.0) * 5 * 48
    plan = plan_layers(menus, budget)
    assert set(plan) == set(menus) and all(plan[layer] in menus[layer] for layer in menus)
    assert sum(o.values for o in plan.values()) <= budget
    assert sum(max(o.cost, 0.0) for o in plan.values()) == pytest.approx(brute_force(menus, budget))


def test_a_drop_wins_where_it_costs_less_than_narrowing_keys_elsewhere():
    """Layer 1's attention is nearly free to drop; layer 0's keys are dear: at half the cache, drop layer 1, keep 0."""
    menus = {
        0: [Option("keep", 48, 0.0), Option("keys", 32, 0.5, 8), Option("drop", 0, 2.0)],
        1: [Option("keep", 48, 0.0), Option("keys", 32, 0.01, 8), Option("drop", 0, 0.02)],
    }
    plan = plan_layers(menus, 48)
    assert (plan[0].action, plan[1].action) == ("keep", "drop")
    everything = plan_layers(menus, 96)
    assert all(o.action == "keep" for o in everything.values())  # nothing to save: nothing changes, at no cost


def test_noise_below_zero_buys_nothing():
    """A measured change below zero counts as zero: with room to keep, the layer keeps (the most values at least cost)."""
    menus = {0: [Option("keep", 48, 0.0), Option("keys", 32, -0.003, 8)]}
    assert plan_layers(menus, 48)[0].action == "keep"


def test_a_budget_no_plan_fits_is_refused():
    menus = {0: [Option("keep", 48, 0.0), Option("keys", 32, 0.1, 8)]}
    with pytest.raises(ValueError, match="no plan fits"):
        plan_layers(menus, 16)
