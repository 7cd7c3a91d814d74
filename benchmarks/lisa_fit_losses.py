"""Local LISA fit losses (relative output error, initial -> final) of the default layer choice, in memory.

    python benchmarks/lisa_fit_losses.py [--source smollm2-135m-instruct] [--layers 3,13,14,16]

Calibration on the built-in text (16 x 256 tokens, as the CLI's defaults); prints one line per fitted layer. The
README's comparison of the fits before and after the input-scale rule of the low-rank rate comes from this script
(run at the commit before the rule for the "before" figures).
"""

import argparse
from pathlib import Path

from common import prepare

from hfcompress.conversion.config import ConvertOptions
from hfcompress.lisa import LisaOptions, select_layers
from hfcompress.sources.source import BUILTIN_SOURCE
from research.inmemory import fit_lisa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=BUILTIN_SOURCE)
    parser.add_argument("--layers", default=None, help="comma-separated; default: the share-ratio default choice")
    args = parser.parse_args()
    options = ConvertOptions(source=args.source, out=Path("."), calib_text="builtin", eval_text="builtin", ood_text="none")
    prepared = prepare(options)
    inputs = prepared.attention_inputs()
    similarity = prepared.similarity(inputs)
    layers = [int(v) for v in args.layers.split(",")] if args.layers else select_layers(
        similarity, prepared.model.config.num_hidden_layers, LisaOptions()
    )
    for record in fit_lisa(prepared.model, inputs, layers, similarity, LisaOptions()):
        rms = inputs[record.layer].pow(2).mean().sqrt().item()
        print(f"layer {record.layer}: input RMS {rms:.2f}, fit loss {record.loss_initial:.4f} -> {record.loss_final:.4f}")


if __name__ == "__main__":
    main()
