"""FASC factorisation, rank allocation and rho on synthetic statistics with known answers."""

import torch

from hfcompress.conversion.calibrate import collect_linear_stats
from hfcompress.fasc import FascOptions, allocate_ranks, decompose, dependence_violation
from research.inmemory import compress_linears


class TwoLinear(torch.nn.Module):
    """Minimal stand-in exposing model.model.layers and a loss path for collect_linear_stats."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 16))])
        self.head = torch.nn.Linear(16, 50)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, inputs_embeds, use_cache=False):
        return type("Out", (), {"logits": self.head(self.model.layers[0](inputs_embeds))})()


def stats_for(seed=0):
    torch.manual_seed(seed)
    model = TwoLinear()
    ids = torch.randint(0, 50, (6, 20))
    return model, collect_linear_stats(model, ids, ["0.0", "0.1"], batch_size=3)


def test_statistics_are_exact_second_moments():
    """C and G against float64 moments of the linear's input and of the summed loss's gradient at its output."""
    model, stats = stats_for()
    torch.manual_seed(0)
    TwoLinear()  # the same draws as stats_for: the same ids
    ids = torch.randint(0, 50, (6, 20))
    first = model.model.layers[0][0]
    inputs, outputs = [], []

    def keep(module, args, out):
        out.retain_grad()
        inputs.append(args[0])
        outputs.append(out)

    hook = first.register_forward_hook(keep)
    logits = model(model.embed(ids)).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1), reduction="sum").backward()
    hook.remove()
    x = inputs[0].detach().reshape(-1, 16).double()
    g = outputs[0].grad.reshape(-1, 24).double()
    s = stats["0.0"]
    assert s.tokens == 6 * 20
    c_measured, g_measured = s.covariances()
    assert torch.allclose(c_measured, x.T @ x / len(x), rtol=1e-5, atol=1e-9)
    assert torch.allclose(g_measured, g.T @ g / len(g), rtol=1e-5, atol=1e-9 * g.pow(2).mean().item())
    assert torch.linalg.eigvalsh(c_measured).min() > -1e-10 and g_measured.trace() > 0


def test_full_rank_reconstructs_weight_for_every_method():
    model, stats = stats_for()
    weight = model.model.layers[0][0].weight.detach()
    for method in ("fisher", "whiten", "svd", "pca"):
        dec = decompose(weight, stats["0.0"], method)
        a, b = dec.factors(16)
        assert torch.allclose((a @ b).float(), weight, atol=1e-4), method


def test_fisher_truncation_minimises_the_surrogate():
    model, stats = stats_for()
    weight = model.model.layers[0][0].weight.detach().double()
    c, g = stats["0.0"].covariances()

    def surrogate(approx):
        delta = approx - weight
        return torch.trace(delta.T @ g @ delta @ c).item()

    fisher = decompose(weight, stats["0.0"], "fisher")
    svd = decompose(weight, stats["0.0"], "svd")
    a, b = fisher.factors(6)
    a2, b2 = svd.factors(6)
    assert surrogate(a @ b) < surrogate(a2 @ b2)


def test_allocation_meets_budget_and_prefers_cheap_loss():
    shapes = {"flat": (32, 32), "steep": (32, 32)}
    flat = type("D", (), {"spectrum": torch.ones(32, dtype=torch.float64)})()
    steep = type("D", (), {"spectrum": torch.tensor([100.0] * 4 + [1e-6] * 28, dtype=torch.float64)})()
    ranks = allocate_ranks({"flat": flat, "steep": steep}, shapes, budget=0.6)
    kept = sum((r * 64 if r is not None else 1024) for r in ranks.values())
    assert kept <= 0.6 * 2048
    assert ranks["steep"] is not None and ranks["steep"] <= 6  # low-rank layer is compressed hard
    assert ranks["flat"] is None or ranks["flat"] > ranks["steep"]


def test_rho_is_small_for_independent_and_large_for_coupled():
    model, stats = stats_for()
    independent = dependence_violation(stats["0.0"])
    s = stats["0.0"]
    coupled = type(s)(**{**s.__dict__})
    coupled.probe_ab = s.probe_ab * 3.0  # E[ab] = 3 E[a]E[b]-ish: strong coupling
    assert dependence_violation(coupled) > independent


def test_compress_linears_respects_budget():
    model, stats = stats_for()
    linears = {"0.0": model.model.layers[0][0], "0.1": model.model.layers[0][1]}
    factors, results = compress_linears(linears, stats, FascOptions(budget=0.5))
    kept = sum(a.numel() + b.numel() for a, b in factors.values()) + sum(
        linears[r.name].weight.numel() for r in results if r.rank is None
    )
    assert kept <= 0.5 * sum(l.weight.numel() for l in linears.values())
    assert {r.name for r in results} == set(linears)


def test_rho_threshold_keeps_untrusted_layers_dense_within_the_budget():
    model, stats = stats_for()
    linears = {"0.0": model.model.layers[0][0], "0.1": model.model.layers[0][1]}
    rhos = {name: dependence_violation(stats[name]) for name in linears}
    untrusted, trusted = sorted(rhos, key=rhos.get, reverse=True)
    threshold = (rhos[untrusted] + rhos[trusted]) / 2
    factors, results = compress_linears(linears, stats, FascOptions(budget=0.8, rho_keep_threshold=threshold))
    ranks = {r.name: r.rank for r in results}
    assert ranks[untrusted] is None and ranks[trusted] is not None
    kept = linears[untrusted].weight.numel() + sum(a.numel() + b.numel() for a, b in factors.values())
    assert kept <= 0.8 * sum(l.weight.numel() for l in linears.values())
