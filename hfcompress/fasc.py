"""Step 4, fasc: Fisher-aligned low-rank factorisation of linear layers, rho diagnostics, one global rank budget.

For y = W x (W: m x n) with C = E[x x^T] and G = E[g g^T] (g = d loss / d y), the K-FAC surrogate of the loss
change is E[d loss^2] ~ tr(dW^T G dW C) = ||G^1/2 dW C^1/2||_F^2. With G^1/2 W C^1/2 = U S V^T, the best rank-k
W is G^-1/2 U_k S_k V_k^T C^-1/2 and its surrogate loss is sum_{i>k} s_i^2. The layer becomes y = A (B x),
A = G^-1/2 U_k S_k (m x k), B = V_k^T C^-1/2 (k x n). Methods:
  fisher  both C and G (default);   whiten  G = I (activation-whitened SVD, SVD-LLM);
  svd     C = G = I (plain SVD);    pca     B = top-k eigenvectors of C (keep the high-variance inputs), A = W B^T.

rho, the dependence-violation score of a layer: K-FAC assumes E[x x^T (x) g g^T] = C (x) G (activations and
gradients independent). With random unit probes u, v we measure
  rho = mean_p | E[(u_p^T x)^2 (v_p^T g)^2] / (E[(u_p^T x)^2] E[(v_p^T g)^2]) - 1 |,
0 when the factorisation is exact; large values mean the Fisher subspace is less trustworthy for that layer.
"""

import math
from dataclasses import asdict, dataclass, replace

import torch

from .atomic import save_atomic
from .calibrate import LinearStats
from .errors import HfcompressError
from .methods import LayerContext, Method, Planner, register

METHODS = ("fisher", "whiten", "svd", "pca")
DEFAULT_TARGETS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj", "self_attn.v_proj")
TARGETABLE = DEFAULT_TARGETS  # every linear of a decoder layer but q/k, which are LISA's
DAMPING = 0.01  # fraction of the mean diagonal added to C and G before square roots / inverses


@dataclass
class FascOptions:
    method: str = "fisher"
    budget: float = 1.0  # fraction of targeted parameters kept; 1.0 = FASC off
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rho_keep_threshold: float | None = None  # layers with rho above this stay dense


def dependence_violation(stats: LinearStats) -> float:
    n = stats.tokens
    ratio = (stats.probe_ab / n) / ((stats.probe_a / n) * (stats.probe_b / n)).clamp_min(1e-300)
    return (ratio - 1).abs().mean().item()


def _sqrt_and_inverse(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cov = cov + DAMPING * cov.diagonal().mean() * torch.eye(len(cov), dtype=cov.dtype, device=cov.device)
    eigval, eigvec = torch.linalg.eigh(cov)
    eigval = eigval.clamp_min(eigval.max() * 1e-12)
    return (eigvec * eigval.sqrt()) @ eigvec.T, (eigvec * eigval.rsqrt()) @ eigvec.T


@dataclass
class Decomposition:
    """Full-rank factorisation of one layer, truncated later to the allocated rank."""

    left: torch.Tensor  # m x r_max: column i is A's i-th column (already scaled by s_i)
    right: torch.Tensor  # r_max x n: row i is B's i-th row
    spectrum: torch.Tensor  # surrogate loss weight of each component, descending

    def factors(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.left[:, :rank].contiguous(), self.right[:rank].contiguous()


def decompose(weight: torch.Tensor, stats: LinearStats, method: str) -> Decomposition:
    """Ordered components of W for `method`; float64 throughout."""
    if method not in METHODS:
        raise HfcompressError(f"Unknown --fasc-method '{method}': choose one of {', '.join(METHODS)}.")
    w = weight.detach().double()
    c, g = (cov.to(w.device) for cov in stats.covariances())
    if method == "pca":
        eigval, eigvec = torch.linalg.eigh(c)
        order = eigval.argsort(descending=True)
        basis = eigvec[:, order]  # n x n, columns by variance
        left = w @ basis
        # surrogate weight of dropping direction i: its variance times how much W uses it
        spectrum = eigval[order].clamp_min(0) * left.pow(2).sum(0)
        return Decomposition(left=left, right=basis.T, spectrum=spectrum)
    eye_m, eye_n = (torch.eye(size, dtype=w.dtype, device=w.device) for size in w.shape)
    c_sqrt, c_isqrt = _sqrt_and_inverse(c) if method in ("fisher", "whiten") else (eye_n, eye_n)
    g_sqrt, g_isqrt = _sqrt_and_inverse(g) if method == "fisher" else (eye_m, eye_m)
    u, s, vh = torch.linalg.svd(g_sqrt @ w @ c_sqrt, full_matrices=False)
    return Decomposition(left=g_isqrt @ (u * s), right=vh @ c_isqrt, spectrum=s.pow(2))


def allocate_ranks(
    decompositions: dict[str, Decomposition], shapes: dict[str, tuple[int, int]], budget: float
) -> dict[str, int | None]:
    """Ranks that keep <= budget of the targeted parameters, spending parameters where the surrogate loss drops most.

    Greedy water-filling: all layers start at rank 0; the next component taken anywhere is the one with the
    largest loss reduction per parameter (sigma_i^2 / (m + n)), until the budget is spent. A layer whose rank
    reaches the break-even point k (m + n) >= m n stays dense. None means dense.
    """
    if not 0.0 < budget <= 1.0:
        raise HfcompressError(f"--fasc-budget must be in (0, 1], got {budget}.")
    if budget >= 1.0:
        return {name: None for name in shapes}
    allowed = budget * sum(m * n for m, n in shapes.values())
    candidates = []
    for name, dec in decompositions.items():
        m, n = shapes[name]
        # cummin keeps each layer's components in order even when its spectrum is not sorted (pca)
        gains = (dec.spectrum.double() / (m + n)).cummin(0).values
        candidates += [(gain, name) for gain in gains.tolist()]
    candidates.sort(key=lambda item: -item[0])
    ranks = {name: 1 for name in shapes}  # every compressed layer keeps at least one component
    dense: set[str] = set()
    cost = sum(m + n for m, n in shapes.values())
    if cost > allowed:
        raise HfcompressError(f"--fasc-budget {budget} cannot be met even at rank 1 everywhere.")
    seen = {name: 0 for name in shapes}
    for _, name in candidates:
        seen[name] += 1
        if name in dense or seen[name] <= 1:
            continue
        m, n = shapes[name]
        if (ranks[name] + 1) * (m + n) >= m * n:  # break-even: the dense weight is no larger
            extra = m * n - ranks[name] * (m + n)
            if cost + extra <= allowed:
                dense.add(name)
                cost += extra
            continue
        if cost + m + n <= allowed:
            ranks[name] += 1
            cost += m + n
    return {name: (None if name in dense else rank) for name, rank in ranks.items()}


@dataclass
class FascLayerResult:
    name: str
    shape: tuple[int, int]
    rank: int | None
    rho: float
    surrogate_loss: float  # sum of dropped spectrum
    spectrum_head: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def trusted_layers(rhos: dict[str, float], options: FascOptions) -> set[str]:
    """The layers whose rho allows a Fisher factorisation; the others stay dense."""
    return {name for name, rho in rhos.items() if options.rho_keep_threshold is None or rho <= options.rho_keep_threshold}


def plan_ranks(
    decompositions: dict[str, Decomposition], shapes: dict[str, tuple[int, int]], options: FascOptions
) -> dict[str, int | None]:
    """Ranks under the global budget for every targeted layer (`shapes`); layers without a decomposition (not
    trusted) stay dense and spend their share of the budget."""
    untrusted_params = sum(m * n for name, (m, n) in shapes.items() if name not in decompositions)
    total = sum(m * n for m, n in shapes.values())
    # the dense untrusted layers spend part of the budget
    trusted_budget = (options.budget * total - untrusted_params) / max(1, total - untrusted_params)
    if trusted_budget <= 0:
        raise HfcompressError("--fasc-budget is smaller than the layers kept dense by the rho threshold.")
    trusted_shapes = {name: shapes[name] for name in decompositions}
    return allocate_ranks(decompositions, trusted_shapes, min(1.0, trusted_budget)) if decompositions else {}


def layer_result(name: str, shape: tuple[int, int], rank: int | None, rho: float, dec: Decomposition | None) -> FascLayerResult:
    return FascLayerResult(
        name=name,
        shape=shape,
        rank=rank,
        rho=rho,
        surrogate_loss=float(dec.spectrum[rank:].sum()) if rank is not None else 0.0,
        spectrum_head=[float(v) for v in dec.spectrum[:8]] if dec is not None else [],
    )


FACTOR_MARKERS = (".proj_in.", ".proj_out.")  # names of a FascLinear's two factors (trainable in distillation)


def is_fasc_parameter(name: str) -> bool:
    return any(marker in name for marker in FACTOR_MARKERS)


def replace_linear(state: dict[str, torch.Tensor], name: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """`state` (full names) with linear `name` ("layer.path") replaced by its factors: proj_in = B, proj_out = A."""
    state, prefix = dict(state), f"model.layers.{name}."
    state.pop(prefix + "weight")
    state[prefix + "proj_in.weight"] = b
    state[prefix + "proj_out.weight"] = a
    if prefix + "bias" in state:
        state[prefix + "proj_out.bias"] = state.pop(prefix + "bias")
    return state


# ------------------------------------------------------------------------------------------- the pipeline unit
@register
class FascMethod(Method):
    """FASC as a pipeline unit: C/G statistics in the backward pass, per-layer factorisations saved as they are
    computed, one global rank budget in plan, the factors swapped in by apply."""

    name = "fasc"
    order = 20
    needs_gradients = True

    def __init__(self, options: FascOptions, seed: int = 0) -> None:
        self.options, self.seed = options, seed
        self.ranks: dict[str, int | None] = {}
        self.results: list[FascLayerResult] = []

    @classmethod
    def from_options(cls, options) -> "FascMethod":
        return cls(replace(options.fasc), options.seed)

    def active(self) -> bool:
        return self.options.budget < 1.0

    def settings(self) -> dict:
        return {**asdict(self.options), "seed": self.seed}

    def calibration_settings(self) -> dict:
        return {k: v for k, v in self.settings().items() if k != "budget"}  # the ranks are planned from the spectra

    def gradient_linears(self, ctx: LayerContext) -> dict[str, torch.nn.Module]:
        return {f"{ctx.index}.{t}": ctx.layer.get_submodule(t) for t in self.options.targets}

    def observe_gradients(self, ctx: LayerContext, stats: dict[str, LinearStats]) -> None:
        """rho of every targeted linear of this layer; for the trusted ones the factorisation, cut at the break-even
        rank (no allocation can give a layer more: it would stay dense), saved in float32."""
        if not ctx.is_main:
            return
        rhos = {name: dependence_violation(stats[name]) for name in stats}
        factors, spectra, shapes = {}, {}, {}
        for name in stats:
            weight = ctx.layer.get_submodule(name.split(".", 1)[1]).weight
            shapes[name] = tuple(weight.shape)
            if name not in trusted_layers(rhos, self.options):
                continue
            dec = decompose(weight, stats[name], self.options.method)
            m, n = weight.shape
            keep = min(len(dec.spectrum), math.ceil(m * n / (m + n)))
            factors[name] = (dec.left[:, :keep].float().cpu(), dec.right[:keep].float().cpu())
            spectra[name] = dec.spectrum.cpu()
        save_atomic(factors, self.store / f"factors-{ctx.index}.pt")
        save_atomic({"rhos": rhos, "shapes": shapes, "spectra": spectra}, self.store / f"fasc-{ctx.index}.pt")

    def plan(self, planner: Planner) -> None:
        """Global ranks from every layer's spectrum (the factors stay on disk) and the per-linear report rows."""
        rhos, shapes, spectra = {}, {}, {}
        for idx in range(planner.num_layers):
            summary = torch.load(self.store / f"fasc-{idx}.pt")
            rhos.update(summary["rhos"])
            shapes.update(summary["shapes"])
            spectra.update(summary["spectra"])
        dropped = set(planner.notes.get("dropped_attention_layers", []))  # LISA's plan ran first (order)
        spectra = {name: s for name, s in spectra.items() if not (int(name.split(".")[0]) in dropped and ".self_attn." in name)}
        empty = torch.empty(0)  # only the spectra drive the allocation
        decompositions = {name: Decomposition(left=empty, right=empty, spectrum=s) for name, s in spectra.items()}
        self.ranks = plan_ranks(decompositions, shapes, self.options)
        self.results = [layer_result(name, shapes[name], self.ranks.get(name), rhos[name], decompositions.get(name)) for name in shapes]

    def _ranked(self, index: int) -> dict[str, int]:
        return {name: r for name, r in self.ranks.items() if r is not None and name.split(".")[0] == str(index)}

    def touches(self, index: int) -> bool:
        return bool(self._ranked(index))

    def apply(self, ctx: LayerContext, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ranked = self._ranked(ctx.index)
        if not ranked:
            return state
        stored = torch.load(self.store / f"factors-{ctx.index}.pt")
        for name, rank in ranked.items():
            state = replace_linear(state, name, *Decomposition(*stored[name], torch.empty(0)).factors(rank))
        return state

    def config_entries(self) -> dict:
        return {"fasc_ranks": {name: r for name, r in self.ranks.items() if r is not None}}

    def report(self) -> dict:
        return {
            "method": self.options.method,
            "budget": self.options.budget,
            "targets": list(self.options.targets),
            "layers": [r.to_dict() for r in self.results],
        }
