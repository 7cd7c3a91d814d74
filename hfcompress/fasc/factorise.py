"""FASC's arithmetic: Fisher-aligned low-rank factorisation of linear layers, rho diagnostics, one global rank budget.

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

from dataclasses import asdict, dataclass

import torch

from ..conversion.calibrate import LinearStats
from ..errors import HfcompressError
from .options import METHODS, FascOptions

DAMPING = 0.01  # fraction of the mean diagonal added to C and G before square roots / inverses


def dependence_violation(stats: LinearStats) -> float:
    n = stats.tokens
    ratio = (stats.probe_ab / n) / ((stats.probe_a / n) * (stats.probe_b / n)).clamp_min(1e-300)
    return (ratio - 1).abs().mean().item()


def damped(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix` (or a batch of them) plus DAMPING times its mean diagonal on the diagonal: invertible, barely moved."""
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    return matrix + DAMPING * matrix.diagonal(dim1=-2, dim2=-1).real.mean(-1, keepdim=True).unsqueeze(-1) * eye


def sqrt_and_inverse(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """M^1/2 and M^-1/2 of a damped symmetric (or Hermitian, or a batch of) covariance."""
    values, vectors = torch.linalg.eigh(damped(matrix))
    values = values.clamp_min(values.max() * 1e-12)
    return (vectors * values.sqrt().unsqueeze(-2)) @ vectors.mH, (vectors * values.rsqrt().unsqueeze(-2)) @ vectors.mH


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
    c_sqrt, c_isqrt = sqrt_and_inverse(c) if method in ("fisher", "whiten") else (eye_n, eye_n)
    g_sqrt, g_isqrt = sqrt_and_inverse(g) if method == "fisher" else (eye_m, eye_m)
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
