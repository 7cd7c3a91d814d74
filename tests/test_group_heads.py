"""`--lisa-group-heads` (LisaOptions.group_heads): the sparse-Align head matching in which the heads of one KV group read
one KV head of the layer below, different groups different ones (what lets the vLLM plugin, hfcompress_vllm, keep a
shared layer and its anchor in one paged cache of no more values a token than the original layers)."""

import itertools

import torch

from hfcompress.lisa import group_matching


def is_grouped(matching: list[int], kv_heads: int) -> bool:
    g = len(matching) // kv_heads
    below = [{matching[h] // g for h in range(j * g, j * g + g)} for j in range(kv_heads)]
    return all(len(s) == 1 for s in below) and len({s.pop() for s in below}) == kv_heads


def total(js: torch.Tensor, matching: list[int]) -> float:
    return sum(js[h, s].item() for h, s in enumerate(matching))


def test_group_matching_is_the_best_grouped_matching():
    """Against every grouped matching of 6 heads in 3 KV groups (brute force): the least total divergence."""
    generator = torch.Generator().manual_seed(0)
    heads, kv = 6, 3
    g = heads // kv
    for _ in range(5):
        js = torch.rand(heads, heads, generator=generator)
        got = group_matching(js, kv)
        assert is_grouped(got, kv)
        best = min(
            total(js, [perm[h // g] * g + picks[h] for h in range(heads)])
            for perm in itertools.permutations(range(kv))
            for picks in itertools.product(range(g), repeat=heads)
        )
        assert abs(total(js, got) - best) < 1e-6


def test_a_grouped_best_match_is_kept():
    """When each head's best match already is grouped (group 0 reads group 1 below and the reverse), it is returned."""
    js = torch.full((4, 4), 1.0)
    for h, s in enumerate([3, 2, 1, 0]):
        js[h, s] = 0.1
    assert group_matching(js, 2) == [3, 2, 1, 0]
    # many KV heads: the greedy assignment still gives a grouped matching
    js = torch.rand(18, 18, generator=torch.Generator().manual_seed(1))
    assert is_grouped(group_matching(js, 9), 9)
