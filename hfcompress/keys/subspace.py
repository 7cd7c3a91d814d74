"""Low-rank keys' arithmetic: a layer's keys k (pre-RoPE, all KV heads side by side, width = KV x d) become P k with
P = A B of limited rank; a cache holds the latent B k.

Layouts:
- `pre`:  P acts on the whole pre-RoPE key (any rank up to the width). RoPE is applied to the reconstruction A z, so a
          cache of latents must rebuild the keys of every cached token at every step (Palu).
- `rope`: P acts per RoPE frequency i on the complex numbers c_h = k_h[i] + j k_h[i + d/2] of the KV heads h. RoPE
          turns every c_h of one frequency by the same phase, so P commutes with it: the cache holds the post-RoPE
          latent and queries read it directly, no reconstruction. A frequency keeps at most KV complex dimensions;
          one costs two cached values.
Criteria (the metric M the projection is optimal under: P = M^-1/2 U U^H M^1/2, U the top eigenvectors of
M^1/2 C M^1/2, C = E[k k^T]):
- `svd`:    W_K's own singular vectors, no data (only where the key is k_proj's output, no k_norm);
- `pca`:    M = I: the keys' variance (activation-whitened SVD of W_K, SVD-LLM's criterion);
- `query`:  M = the energy of the queries that read each KV head's RoPE plane (ThinK's criterion as a metric);
- `fisher`: M = G = E[g g^T], g = d loss / d k: FASC's Fisher-aligned criterion.
Whatever the criterion, `cost(n)` is the Fisher surrogate of the loss change, tr(G (I - P) C (I - P)^T), in loss units:
comparable across layers, so one budget of cached values is spent where it lowers the loss most (`plan_sizes`).
"""

import torch

from ..fasc.factorise import damped, sqrt_and_inverse
from .statistics import KeyStatistics

CRITERIA = ("svd", "pca", "query", "fisher")
LAYOUTS = ("pre", "rope")


def rope_planes(width: int, head_dim: int) -> torch.Tensor:
    """(frequencies, KV heads, 2): the coordinates of each head's RoPE plane (i, i + d/2), transformers' rotate_half."""
    heads, half = width // head_dim, head_dim // 2
    base = torch.arange(heads).unsqueeze(0) * head_dim + torch.arange(half).unsqueeze(1)  # (F, H)
    return torch.stack([base, base + half], dim=-1)


def to_complex(matrix: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """Per frequency, the Hermitian (heads x heads) E[c c^H] from the real second moment `matrix` of the keys."""
    re, im = planes[..., 0], planes[..., 1]

    def block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return matrix[a.unsqueeze(-1), b.unsqueeze(-2)]

    return torch.complex(block(re, re) + block(im, im), block(im, re) - block(re, im))


def from_complex(blocks: torch.Tensor, planes: torch.Tensor, width: int) -> torch.Tensor:
    """The real (width x width) matrix of per-frequency complex maps `blocks` (F, H, H) acting on c = re + j im."""
    out = torch.zeros(width, width, dtype=blocks.real.dtype)
    re, im = planes[..., 0].unsqueeze(-1), planes[..., 1].unsqueeze(-1)
    re_t, im_t = planes[..., 0].unsqueeze(-2), planes[..., 1].unsqueeze(-2)
    out[re, re_t], out[re, im_t] = blocks.real, -blocks.imag
    out[im, re_t], out[im, im_t] = blocks.imag, blocks.real
    return out


def query_metric(q2: torch.Tensor, width: int, head_dim: int) -> torch.Tensor:
    """Diagonal metric on the keys: per KV head and RoPE plane, the energy of the group's queries on that plane
    (both coordinates alike: RoPE turns the plane, so only its total energy is position-independent)."""
    kv_heads, half = width // head_dim, head_dim // 2
    energy = q2.reshape(kv_heads, -1, head_dim).sum(1)  # query heads of a KV group are consecutive
    plane = (energy[:, :half] + energy[:, half:]) / 2
    return torch.diag(torch.cat([plane, plane], dim=1).reshape(-1))


class KeySubspace:
    """One layer's key directions under one criterion and layout, best first: `projector(n)` keeps the first n (real
    dimensions for `pre`, complex ones for `rope`: `values_per_step` cached values each), `cost(n)` is its Fisher
    surrogate (needs G; without it, the keys' lost variance)."""

    def __init__(self, stats: KeyStatistics, weight: torch.Tensor, criterion: str, layout: str, head_dim: int):
        if criterion not in CRITERIA or layout not in LAYOUTS:
            raise ValueError(f"unknown criterion {criterion!r} or layout {layout!r}")
        if criterion == "fisher" and stats.G is None:
            raise ValueError("the fisher criterion needs gradient statistics (key_statistics(..., gradients=True))")
        self.layout, self.C = layout, stats.C
        self.width = width = stats.C.shape[0]
        self.G = damped(stats.G) if stats.G is not None else torch.eye(width, dtype=torch.float64)
        metric = {
            "svd": None, "pca": torch.eye(width, dtype=torch.float64), "query": query_metric(stats.q2, width, head_dim),
            "fisher": stats.G,
        }[criterion]  # fmt: skip
        self.values_per_step = 1 if layout == "pre" else 2
        self._costs: dict[int, float] = {}
        if layout == "pre":
            if metric is None:
                left = torch.linalg.svd(weight.double(), full_matrices=False).U
                self.down, self.up = left.T, left
            else:
                root, inverse = sqrt_and_inverse(metric)
                values, vectors = torch.linalg.eigh(root @ self.C @ root)
                ordered = vectors[:, values.argsort(descending=True)]
                self.down, self.up = ordered.T @ root, inverse @ ordered  # P_n = up[:, :n] @ down[:n]
            self.max_size = self.up.shape[1]
            return
        self.planes = rope_planes(width, head_dim)
        frequencies, heads = self.planes.shape[:2]
        if metric is None:  # W_K's complex rows per frequency, their left singular vectors
            w = weight.double()
            left, singular, _ = torch.linalg.svd(torch.complex(w[self.planes[..., 0]], w[self.planes[..., 1]]), full_matrices=False)
            eye = torch.eye(heads, dtype=torch.complex128).expand(frequencies, heads, heads)
            self.roots, self.inverses, self.vectors, values = eye, eye, left, singular.pow(2)
        else:
            self.roots, self.inverses = sqrt_and_inverse(to_complex(metric, self.planes))
            values, vectors = torch.linalg.eigh(self.roots @ to_complex(self.C, self.planes) @ self.roots)
            order = values.argsort(dim=-1, descending=True)
            values, self.vectors = values.gather(-1, order), vectors.gather(-1, order.unsqueeze(-2).expand_as(vectors))
        # the layer's complex directions across frequencies, best first by the criterion's own eigenvalue
        best = values.reshape(-1).argsort(descending=True)
        self.order = torch.stack([best // heads, best % heads], dim=1)
        self.max_size = frequencies * heads

    def projector(self, n: int) -> torch.Tensor:
        """(width, width) P of the first n directions."""
        if self.layout == "pre":
            return self.up[:, :n] @ self.down[:n]
        keep = torch.zeros(self.vectors.shape[0], self.vectors.shape[-1], dtype=torch.bool)
        keep[self.order[:n, 0], self.order[:n, 1]] = True
        kept = self.vectors * keep.unsqueeze(-2)
        return from_complex(self.inverses @ kept @ kept.mH @ self.roots, self.planes, self.width)

    def cost(self, n: int) -> float:
        if n not in self._costs:
            residual = torch.eye(self.width, dtype=torch.float64) - self.projector(n)
            self._costs[n] = float(torch.trace(self.G @ residual @ self.C @ residual.T))
        return self._costs[n]


def plan_sizes(subspaces: list[KeySubspace], budget_values: int, floor: int = 0) -> list[int]:
    """Per layer, how many directions to keep (at least `floor`) so that the cached key values of all layers together
    stay within `budget_values` and the summed surrogate cost is low: greedy, each step adds the direction that lowers
    the cost most per cached value."""
    sizes = [min(floor, sub.max_size) for sub in subspaces]
    spent = sum(size * sub.values_per_step for size, sub in zip(sizes, subspaces))
    while True:
        best, best_gain = None, 0.0
        for index, sub in enumerate(subspaces):
            if sizes[index] >= sub.max_size or spent + sub.values_per_step > budget_values:
                continue
            gain = (sub.cost(sizes[index]) - sub.cost(sizes[index] + 1)) / sub.values_per_step
            if best is None or gain > best_gain:
                best, best_gain = index, gain
        if best is None:
            return sizes
        sizes[best] += 1
        spent += subspaces[best].values_per_step
