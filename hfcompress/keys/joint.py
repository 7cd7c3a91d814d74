"""One plan of every attention layer's action under one KV budget, from measured costs: keep, low-rank keys at one of
several widths, or drop the attention.

Each layer offers a menu of (cached values a token, cost) options, the cost being the loss change of that action alone
on calibration tokens. The plan is the menu choice per layer of least summed cost whose cached values fit the budget:
a multiple-choice knapsack, solved exactly by dynamic programming over the values in units of their greatest common
divisor (30 layers, a dozen options: well under a second). Costs measured below zero count as zero: at this size they
are noise, not gains, and a plan must not spend budget chasing them.
"""

from dataclasses import dataclass
from functools import reduce
from math import gcd, inf


@dataclass(frozen=True)
class Option:
    action: str  # "keep", "keys" or "drop"
    values: int  # values a token the layer caches with it
    cost: float  # measured loss change of this action alone (mean nats a token)
    width: int | None = None  # the key latent's width (keys)


def plan_layers(menus: dict[int, list[Option]], budget_values: float) -> dict[int, Option]:
    """Per layer, one option of its menu, the summed cached values at most `budget_values`, the summed cost least.
    Raises ValueError if even the smallest option of every layer does not fit."""
    unit = reduce(gcd, (o.values for menu in menus.values() for o in menu), 0) or 1
    capacity = int(budget_values // unit)
    if sum(min(o.values for o in menu) for menu in menus.values()) // unit > capacity:
        raise ValueError(f"no plan fits {budget_values} values a token")
    # best[v]: least cost of the layers so far caching exactly v units; choice[i][v]: layer i's option there
    best, choices = [0.0] + [inf] * capacity, []
    for menu in menus.values():
        nxt, choice = [inf] * (capacity + 1), [None] * (capacity + 1)
        for option in menu:
            size, cost = option.values // unit, max(option.cost, 0.0)
            for v in range(size, capacity + 1):
                total = best[v - size] + cost
                if total < nxt[v]:
                    nxt[v], choice[v] = total, option
        best = nxt
        choices.append(choice)
    v = min(range(capacity + 1), key=lambda u: (best[u], -u))  # the least cost, then the most values it keeps
    plan = []
    for layer_choice in reversed(choices):
        option = layer_choice[v]
        plan.append(option)
        v -= option.values // unit
    return dict(zip(menus, reversed(plan)))
