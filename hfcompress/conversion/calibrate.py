"""Step 2, calibrate: run calibration sequences through the original model and keep what LISA and FASC need.

- LISA: every layer's attention input (the output of `input_layernorm`), from which scores, attention maps and
  target outputs are recomputed exactly with the original weights.
- FASC: for every targeted linear y = W x, the input covariance C = E[x x^T], the output-gradient covariance
  G = E[g g^T] (g = d loss / d y of the token-summed next-token loss), and random-probe moments for the
  dependence-violation score rho (see fasc.py). Each batch's products are float32 and the sums over batches
  float64: a float64 Gram costs 2x on a CPU, and float32 moves C and G by < 3e-7 (benchmarks/fasc_statistics.py).
Results are cached on disk under a key of (model, text, settings), so a rerun resumes without recomputing.
"""

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
from torch import nn

from .atomic import save_atomic
from ..errors import HfcompressError
from ..progress import console, progress_bar

RHO_PROBES = 64


def cache_key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# modules that compute nothing a conversion caches (serving in vLLM, the eval and analyze commands, the card, plots,
# pushing): editing them keeps the calibration cache
NOT_CACHED = ("vllm_engine.py", "evaluate.py", "harness.py", "analyze.py", "card.py", "plots.py", "push.py")


def fingerprinted_sources(package: Path) -> list[Path]:
    """The sources `code_fingerprint` hashes: `package`'s modules, its subpackages' included, but NOT_CACHED ones."""
    return sorted(p for p in package.rglob("*.py") if p.name not in NOT_CACHED)


@cache
def code_fingerprint() -> str:
    """Hash of hfcompress's and the converted modeling's source: part of the work-directory key, so that a rerun
    after an upgrade or a fix recomputes instead of reusing statistics, fits or trained weights of the old code."""
    from ..remote import modeling_dir

    digest = hashlib.sha256()
    # in a wheel the modeling sits inside the package, which fingerprinted_sources walks
    files = {*fingerprinted_sources(Path(__file__).resolve().parents[1]), *modeling_dir().glob("*.py")}
    for path in sorted(files):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def tensor_fingerprint(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]


def load_or_compute(path: Path, compute):
    """torch.load(path) if a previous run finished it, else compute, save atomically, return.

    The cache only saves time: an unreadable entry is recomputed and a failed save (say, a full disk) is logged and
    skipped, leaving no partial file behind.
    """
    if path.is_file():
        try:
            return torch.load(path, weights_only=False)
        except Exception as err:  # torch/pickle raise many types on a damaged file
            console.log(f"[yellow]cache entry {path.name} is unreadable ({type(err).__name__}); recomputing it[/]")
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_atomic(value, path)
    except (OSError, RuntimeError) as err:  # torch reports a failed write as RuntimeError
        console.log(f"[yellow]could not cache {path.name} ({err}); continuing without it[/]")
    return value


@torch.no_grad()
def collect_attention_inputs(model: nn.Module, sequences: torch.Tensor, batch_size: int = 4) -> list[torch.Tensor]:
    """Per layer, the normalised hidden states entering self-attention: a list of (N, T, d) float32 tensors."""
    layers = model.model.layers
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = []
    for idx, layer in enumerate(layers):

        def grab(module, args, kwargs, idx=idx):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            captured[idx].append(hidden.detach().float())

        hooks.append(layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        for start in progress_bar(range(0, len(sequences), batch_size), "calibrate: attention inputs"):
            model(sequences[start : start + batch_size], use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    inputs = [torch.cat(chunks) for chunks in captured]
    if not all(torch.isfinite(x).all() for x in inputs):
        raise HfcompressError("The model produced NaN/inf activations on the calibration text; its weights are broken.")
    return inputs


@dataclass
class LinearStats:
    """Second-order statistics of one linear layer over calibration tokens (float64 sums)."""

    in_features: int
    out_features: int
    tokens: int = 0
    xx: torch.Tensor | None = None  # sum x x^T
    gg: torch.Tensor | None = None  # sum g g^T
    probe_in: torch.Tensor | None = None  # (in, P) random unit probes u
    probe_out: torch.Tensor | None = None  # (out, P) random unit probes v
    probe_a: torch.Tensor | None = None  # sum (u^T x)^2
    probe_b: torch.Tensor | None = None  # sum (v^T g)^2
    probe_ab: torch.Tensor | None = None  # sum (u^T x)^2 (v^T g)^2
    extra: dict = field(default_factory=dict)

    def covariances(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.xx / self.tokens, self.gg / self.tokens


def _new_stats(linear: nn.Linear, generator: torch.Generator, device: torch.device) -> LinearStats:
    n, m = linear.in_features, linear.out_features
    probe_in = torch.randn(n, RHO_PROBES, generator=generator, dtype=torch.float64).to(device)
    probe_out = torch.randn(m, RHO_PROBES, generator=generator, dtype=torch.float64).to(device)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.float64, device=device)

    return LinearStats(
        in_features=n,
        out_features=m,
        xx=zeros(n, n),
        gg=zeros(m, m),
        probe_in=probe_in / probe_in.norm(dim=0),
        probe_out=probe_out / probe_out.norm(dim=0),
        probe_a=zeros(RHO_PROBES),
        probe_b=zeros(RHO_PROBES),
        probe_ab=zeros(RHO_PROBES),
    )


def new_linear_stats(
    linears: dict[str, nn.Linear], generator: torch.Generator, device: torch.device | str = "cpu"
) -> dict[str, LinearStats]:
    """Empty float64 statistics on `device` for `linears`; the rho probes are drawn from `generator` in order."""
    return {name: _new_stats(linear, generator, torch.device(device)) for name, linear in linears.items()}


def track_linear_stats(linears: dict[str, nn.Module], stats: dict[str, LinearStats]) -> list:
    """Hooks that accumulate `stats` of each linear: C and the x-probe moments on every forward, G and the paired
    probe moments when the output's gradient arrives. Returns the handles to remove."""
    hooks = []
    for name, linear in linears.items():
        entry = stats[name]

        def on_forward(module, args, output, entry=entry):
            x = args[0].detach().reshape(-1, entry.in_features).float()
            entry.xx += (x.T @ x).double()
            entry.tokens += x.shape[0]
            a = (x.double() @ entry.probe_in) ** 2
            entry.probe_a += a.sum(0)
            entry.extra["a"] = a  # paired with this batch's gradient in on_grad

            def on_grad(grad, entry=entry):
                g = grad.detach().reshape(-1, entry.out_features).float()
                entry.gg += (g.T @ g).double()
                b = (g.double() @ entry.probe_out) ** 2
                entry.probe_b += b.sum(0)
                entry.probe_ab += (entry.extra.pop("a") * b).sum(0)

            output.register_hook(on_grad)

        hooks.append(linear.register_forward_hook(on_forward))
    return hooks


def collect_linear_stats(
    model: nn.Module, sequences: torch.Tensor, targets: list[str], batch_size: int = 4, seed: int = 0
) -> dict[str, LinearStats]:
    """C, G and rho probe moments for each targeted linear (names relative to `model.model.layers`)."""
    layers = model.model.layers
    linears = {name: layers.get_submodule(name) for name in targets}
    stats = new_linear_stats(linears, torch.Generator().manual_seed(seed))
    hooks = track_linear_stats(linears, stats)
    embed = model.get_input_embeddings()
    try:
        for start in progress_bar(range(0, len(sequences), batch_size), "calibrate: Fisher statistics"):
            ids = sequences[start : start + batch_size]
            with torch.enable_grad():
                embeds = embed(ids).detach().requires_grad_(True)  # gives the backward pass a leaf to reach
                logits = model(inputs_embeds=embeds, use_cache=False).logits
                loss = nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum"
                )
                if not torch.isfinite(loss):
                    raise HfcompressError("The calibration loss is NaN/inf: the source weights are broken.")
                loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    for entry in stats.values():
        entry.extra.clear()
    return stats
