"""FASC's options (`--fasc-*`): every field's default and help, and their range checks (`validate`)."""

from dataclasses import dataclass

from ..errors import HfcompressError
from ..conversion.options import option

METHODS = ("fisher", "whiten", "svd", "pca")
DEFAULT_TARGETS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj", "self_attn.v_proj")
TARGETABLE = DEFAULT_TARGETS  # every linear of a decoder layer but q/k, which are LISA's


@dataclass
class FascOptions:
    method: str = option("fisher", f"FASC subspace: {', '.join(METHODS)}.")
    # fraction of targeted parameters kept; 1.0 = FASC off
    budget: float = option(1.0, "FASC: fraction of targeted linear parameters kept (1.0 = off).")
    targets: tuple[str, ...] = option(DEFAULT_TARGETS, "FASC: linear layers to factorise.")  # the CLI: comma-separated
    # layers with rho above this stay dense
    rho_keep_threshold: float | None = option(
        None, "FASC: linears whose rho (activation-gradient dependence) exceeds this stay dense (default: none)."
    )

    def validate(self) -> "FascOptions":
        """The method, the budget's range, the targets and the rho threshold (one HfcompressError naming the first bad one)."""
        if self.method not in METHODS:
            raise HfcompressError(f"Unknown --fasc-method '{self.method}': choose one of {', '.join(METHODS)}.")
        if not 0.0 < self.budget <= 1.0:
            raise HfcompressError(f"--fasc-budget must be in (0, 1] (1.0 = off), got {self.budget}.")
        unknown = [t for t in self.targets if t not in TARGETABLE]
        if unknown or not self.targets:
            raise HfcompressError(
                f"--fasc-targets {','.join(unknown) or '(empty)'} cannot be factorised: choose from {', '.join(TARGETABLE)} "
                "(q_proj/k_proj are LISA's)."
            )
        if self.rho_keep_threshold is not None and not self.rho_keep_threshold >= 0:
            raise HfcompressError(f"--fasc-rho-keep must be >= 0, got {self.rho_keep_threshold}.")
        return self
