"""The in-memory setup the research benchmarks share: a loaded source model, its calibration and evaluation tokens,
and its attention inputs, similarity and FASC statistics (cached like the pipeline's own).

The conversion itself streams layer by layer (hfcompress/conversion/pipeline.py); these scripts load SmolLM2 whole to compare
variants of one step quickly, with the in-memory research driver (research/inmemory.py: fit_lisa, compress_linears,
build_converted_model).
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from hfcompress.conversion.calibrate import cache_key, collect_attention_inputs, collect_linear_stats, load_or_compute, tensor_fingerprint
from hfcompress.conversion.config import ConvertOptions
from hfcompress.sources.source import load_source, resolve_source, source_identity
from hfcompress.sources.token_streams import token_streams
from research.inmemory import measure_similarity


@dataclass
class Prepared:
    model: torch.nn.Module
    tokenizer: object
    sequences: torch.Tensor  # (N, T) calibration sequences
    eval_ids: torch.Tensor  # held-out tokens for perplexity
    cache: Path

    def attention_inputs(self) -> list[torch.Tensor]:
        return load_or_compute(self.cache / "attention_inputs.pt", lambda: collect_attention_inputs(self.model, self.sequences))

    def similarity(self, attn_inputs: list[torch.Tensor]) -> list:
        return load_or_compute(self.cache / "similarity.pt", lambda: measure_similarity(self.model, attn_inputs))

    def linear_stats(self, targets: tuple[str, ...], seed: int) -> dict:
        names = [f"{i}.{t}" for i in range(self.model.config.num_hidden_layers) for t in targets]
        return load_or_compute(
            self.cache / f"linear_stats-{cache_key(sorted(names), seed)}.pt",
            lambda: collect_linear_stats(self.model, self.sequences, names, seed=seed),
        )


def prepare(options: ConvertOptions) -> Prepared:
    source = resolve_source(options.source, options.revision, None, options.trust_remote_code)
    model, tokenizer = load_source(source)
    streams = token_streams(options, tokenizer)
    sequences, eval_ids = streams.sequences, next(iter(streams.evaluations.values()))
    cache = options.cache_dir / "benchmarks" / cache_key(source_identity(source), tensor_fingerprint(sequences))
    return Prepared(model, tokenizer, sequences, eval_ids, cache)


def prepare_smollm2_wiki(calib_sequences: int, seq_len: int, threads: int | None = None) -> Prepared:
    """The built-in SmolLM2 with `calib_sequences` x `seq_len` calibration tokens of `wiki` (`threads`: torch's)."""
    if threads:
        torch.set_num_threads(threads)
    return prepare(ConvertOptions(
        source="smollm2-135m-instruct", out=Path("."), calib_text="wiki", eval_text="wiki", ood_text="none",
        calib_sequences=calib_sequences, seq_len=seq_len,
    ))  # fmt: skip
