"""`hfcompress eval`: perplexity, factual probe and speed of a converted model, optionally beside a baseline."""

import json
from pathlib import Path

import torch
from rich.table import Table

from .errors import HfcompressError
from .probe import run_probe
from .progress import console
from .source import load_source, resolve_source
from .speed import compare_speed
from .text import check_text_option, evaluation_ids, load_text, other_domain_ids
from .validate import perplexity


def load_converted(model: str, trust_remote_code: bool):
    """A converted model (directory or Hub id) through AutoModelForCausalLM, as users load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model)
    ours = (path / "hfcompress_report.json").is_file()
    if not (ours or trust_remote_code):
        raise HfcompressError(
            f"{model} is not a local hfcompress output; pass --trust-remote-code to run the code it ships."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
        loaded = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True, dtype=torch.float32)
    except OSError as err:
        raise HfcompressError(f"Cannot load {model}: {err}".splitlines()[0]) from err
    return loaded.eval(), tokenizer


def evaluate(
    model_name: str,
    baseline: str | None,
    eval_text: str,
    ood_text: str,
    context: int,
    stride: int | None,
    eval_tokens: int | None,
    speed: bool,
    probe: bool,
    trust_remote_code: bool,
) -> dict:
    models = {}
    check_text_option(eval_text, "evaluation")  # a bad text option fails before any model loads
    check_text_option(ood_text, "other-domain")
    converted, tokenizer = load_converted(model_name, trust_remote_code)
    if baseline:
        models["baseline"], _ = load_source(resolve_source(baseline))
    models["model"] = converted
    ids, text_name = evaluation_ids(tokenizer, load_text(eval_text, "evaluation"))
    report = Path(model_name) / "hfcompress_report.json"
    calibration = json.loads(report.read_text())["calibration"]["text"] if report.is_file() else ""
    other = other_domain_ids(tokenizer, ood_text, calibration)
    result: dict = {"eval_text": text_name, "other_domain_text": other[1] if other else None, "models": {}}
    for name, model in models.items():
        entry = {"perplexity": perplexity(model, ids, context, stride, eval_tokens, label=f"perplexity: {name}").to_dict()}
        if other:
            entry["other_domain_perplexity"] = perplexity(
                model, other[0], context, stride, eval_tokens, label=f"perplexity: {name}, other domain"
            ).to_dict()
        if probe:
            entry["probe"] = {k: v for k, v in run_probe(model, tokenizer).to_dict().items() if k != "per_fact"}
        result["models"][name] = entry
    if speed:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        prompt = ids[:512].unsqueeze(0).to(device)
        for model in models.values():
            model.to(device)
        for name, measured in compare_speed(models, prompt).items():
            result["models"][name]["speed"] = measured.to_dict()
        result["device"] = str(device)

    table = Table(title=f"hfcompress eval ({text_name}{'; other domain: ' + other[1] if other else ''})")
    for column in ("model", "perplexity", "other-domain perplexity", "probe", "prefill tok/s", "decode tok/s"):
        table.add_column(column)
    for name, entry in result["models"].items():
        table.add_row(
            name,
            f"{entry['perplexity']['perplexity']:.3f}",
            f"{entry['other_domain_perplexity']['perplexity']:.3f}" if other else "-",
            f"{entry['probe']['correct']}/{entry['probe']['total']}" if "probe" in entry else "-",
            f"{entry['speed']['prefill_tokens_per_s']:.0f}" if "speed" in entry else "-",
            f"{entry['speed']['decode_tokens_per_s']:.1f}" if "speed" in entry else "-",
        )
    console.print(table)
    return result
