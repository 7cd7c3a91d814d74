"""One conversion, opened: the checked source, its tokens, the layer stream and where the calibration cache is.

`Run.open` is the fetch step in one call: it resolves and checks the source, tokenises the texts, sets up the layer
stream on this process's device and gives every method its directory in the calibration cache. What it returns is
complete; only the step log (`Steps`: timings, peak memory) grows while the run goes on.
"""

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from .calibrate import cache_key, code_fingerprint, tensor_fingerprint
from .checkpoint import Checkpoint, check_checkpoint, open_checkpoint
from .config import OUTPUT_DTYPES, ConvertOptions, resolve_device
from ..errors import HfcompressError
from ..memory import peak_memory
from .methods import LayerContext, Method
from .preflight import check_config, check_source
from ..progress import console
from ..evidence.report import public_command
from ..sources.source import ResolvedSource, load_tokenizer, resolve_source, source_identity
from .stream import LayerStream, Processes
from ..sources.token_streams import TokenStreams, token_streams


def output_dtype(requested: str, source: ResolvedSource, source_config) -> torch.dtype:
    """The saved weights' dtype: as requested, or for "auto" the dtype the source checkpoint declares (a GGUF
    declares none: its dequantised weights are saved as bfloat16, the dtype Llama checkpoints ship in)."""
    if requested != "auto":
        return OUTPUT_DTYPES[requested]
    if source.gguf_file:
        return torch.bfloat16
    declared = getattr(source_config, "dtype", None) or getattr(source_config, "torch_dtype", None) or torch.float32
    declared = getattr(torch, declared) if isinstance(declared, str) else declared
    return declared if declared in OUTPUT_DTYPES.values() else torch.float32


@dataclass
class Steps:
    """The run's step log: each step's wall time and the running peak RSS after it (which step set the peak)."""

    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def step(self, name: str):
        console.log(f"[bold cyan]{name}[/]")
        start = time.perf_counter()
        yield
        self.timings[name] = round(time.perf_counter() - start, 2)
        self.peaks[name] = peak_memory()["peak_rss_mb"]


@dataclass(frozen=True, eq=False)
class Run:
    """One conversion's shared state: options, source, tokens, stream, processes, where its files go, its step log."""

    options: ConvertOptions
    command: str  # the command line, for the report: absolute paths reduced to their last part
    steps: Steps
    processes: Processes
    device: torch.device
    source: ResolvedSource
    tokenizer: object
    checkpoint: Checkpoint
    source_config: object
    streams: TokenStreams
    stream: LayerStream
    sequences: torch.Tensor  # this process's calibration sequences
    calib_dir: Path
    saved_dtype: torch.dtype

    @classmethod
    def open(
        cls, options: ConvertOptions, methods: list[Method], token: str | None = None, argv: list[str] | None = None,
        steps: Steps | None = None,
    ) -> "Run":
        """Resolve and check the source, tokenise the texts, set up the stream and the methods' cache directories.
        `argv` is the command's arguments (None: this process's); `steps` the log the caller timed the opening in."""
        processes = Processes()
        device = resolve_device(options.device, processes.state.local_process_index)
        source = resolve_source(
            options.source, options.revision, token, options.trust_remote_code, partial(check_config, options)
        )
        check_source(options, source)  # sequence lengths vs. the context, disk for a GGUF's dequantising: before both
        tokenizer = load_tokenizer(source)
        checkpoint, source_config = open_checkpoint(source, options.cache_dir)
        options.check_against_model(source_config)
        for method in methods:
            method.check_model(source_config)
        check_checkpoint(checkpoint, source_config)
        streams = token_streams(options, tokenizer)
        sequences = streams.sequences
        if int(max(ids.max() for ids in (streams.calib_ids, *streams.evaluations.values()))) >= source_config.vocab_size:
            raise HfcompressError(f"The tokenizer of {source.name} makes ids beyond the model's vocabulary ({source_config.vocab_size}).")
        if len(sequences) % processes.count:
            raise HfcompressError(f"--calib-sequences {len(sequences)} must be a multiple of the {processes.count} processes.")
        saved_dtype = output_dtype(options.dtype, source, source_config)
        stream = LayerStream(source_config, checkpoint, device)
        share = len(sequences) // processes.count
        run = cls(
            options=options, command=public_command(argv if argv is not None else sys.argv[1:]),
            steps=steps or Steps(), processes=processes, device=device, source=source, tokenizer=tokenizer,
            checkpoint=checkpoint, source_config=source_config, streams=streams, stream=stream,
            sequences=sequences[processes.index * share : (processes.index + 1) * share],
            calib_dir=options.cache_dir / cache_key(source_identity(source), tensor_fingerprint(sequences), code_fingerprint()),
            saved_dtype=saved_dtype,
        )
        for method in methods:  # its own directory, keyed by the settings that change what it computes
            method.store = run.calib_dir / f"{method.name}-{cache_key(method.calibration_settings())}"
            method.store.mkdir(parents=True, exist_ok=True)
        return run

    def step(self, name: str):
        """A named step of the run: logged when it starts, timed, the peak memory after it recorded."""
        return self.steps.step(name)

    @property
    def prefix(self) -> list[int]:
        return self.streams.prefix  # in front of every window

    def process_dir(self, directory: Path) -> Path:
        path = directory / f"process{self.processes.index}-of-{self.processes.count}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def hidden_dir(self) -> Path:
        return self.process_dir(self.calib_dir / "hidden")

    def hidden(self, idx: int) -> torch.Tensor:
        return torch.load(self.hidden_dir / f"hidden-{idx}.pt")

    def context(self, idx: int, layer: torch.nn.Module, hidden: torch.Tensor, output_gradient: torch.Tensor | None = None) -> LayerContext:
        """The LayerContext of layer idx, whose input hidden states (this process's) are `hidden`; in the backward pass
        `output_gradient`, the loss gradient at its output (this process's)."""
        stream, processes, cache = self.stream, self.processes, {}

        def attention_input() -> torch.Tensor:
            if "x" not in cache:
                with torch.no_grad():
                    parts = [layer.input_layernorm(hidden[i : i + stream.batch_size].to(self.device)) for i in range(0, len(hidden), stream.batch_size)]
                cache["x"] = processes.gather(torch.cat(parts))
            return cache["x"]

        def hidden_input() -> torch.Tensor:
            return processes.gather(hidden.to(self.device))

        def previous() -> LayerContext | None:
            if idx == 0:
                return None
            return self.context(idx - 1, stream.original_layer(idx - 1), self.hidden(idx - 1))

        def gradient() -> torch.Tensor:
            return processes.gather(output_gradient.to(self.device))

        return LayerContext(
            index=idx, num_layers=stream.num_layers, layer=layer, device=self.device, attention_input=attention_input,
            cos_sin=lambda seq_len: stream.cos_sin(seq_len, idx), previous=previous, is_main=processes.is_main,
            hidden_input=hidden_input, output_gradient=gradient if output_gradient is not None else None,
            run_layer=lambda module, inputs: stream.run(module, inputs)[0],
        )
