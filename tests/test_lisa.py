"""LISA layer choice (share ratio, explicit layers, perplexity-budget search) and resumable per-layer fits."""

import pytest

from hfcompress.errors import HfcompressError
from hfcompress.lisa import LayerSimilarity, LisaOptions, ranked_candidates, search_layers_by_perplexity, select_layers


def similarity(errors: dict[int, float]) -> list[LayerSimilarity]:
    return [LayerSimilarity(layer, 0.3, 0.2, [0], [0.2], error) for layer, error in errors.items()]


ERRORS = {1: 0.9, 2: 0.5, 3: 0.1, 4: 0.3, 5: 0.2, 6: 0.05, 7: 0.4}


def test_ranked_candidates_skip_protected_layers_and_sort_by_aligned_error():
    assert ranked_candidates(similarity(ERRORS), LisaOptions(protect_first=2)) == [6, 3, 5, 4, 7, 2]


def test_share_ratio_and_explicit_layers():
    assert select_layers(similarity(ERRORS), 8, LisaOptions(share_ratio=0.25, protect_first=2)) == [3, 6]
    assert select_layers(similarity(ERRORS), 8, LisaOptions(layers=[5, 2, 5])) == [2, 5]
    with pytest.raises(HfcompressError, match="out of range"):
        select_layers(similarity(ERRORS), 8, LisaOptions(layers=[0]))


@pytest.mark.parametrize("limit, expected", [(10.0, []), (10.5, [6]), (12.2, [3, 4, 5, 6]), (99.0, [2, 3, 4, 5, 6, 7])])
def test_perplexity_search_takes_the_most_layers_within_budget(limit, expected):
    ranked = [6, 3, 5, 4, 7, 2]
    calls = []

    def perplexity_of(layers):  # each shared layer costs +0.5 perplexity
        calls.append(layers)
        return 10.0 + 0.5 * len(layers)

    chosen, probes = search_layers_by_perplexity(ranked, perplexity_of, limit)
    assert chosen == expected
    assert len(calls) <= 3  # log2(6 + 1) probes, not one per count
    assert all(p["within_budget"] == (p["perplexity"] <= limit) for p in probes)
    assert all(p["layers"] == sorted(ranked[: p["count"]]) for p in probes)
