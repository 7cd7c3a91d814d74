"""`hfcompress eval`: perplexity, factual probe, speed and lm-eval tasks of a converted model, beside a baseline."""

import json
from contextlib import nullcontext
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from rich.table import Table

from .card import write_card
from ..errors import HfcompressError
from .harness import LmEvalOptions, run_lm_eval
from .probe import run_probe
from ..progress import console
from .report import REPORT_FILE
from ..sources.source import (
    BUILTIN_SOURCE, ResolvedSource, _first_line, is_local_source, load_source, looks_like_repo_id, read_json_object, resolve_source,
)  # fmt: skip
from .speed import compare_speed
from ..sources.text import check_text_option, evaluation_ids, load_text, local_source_texts, other_domain_ids, window_prefix
from .validate import perplexity


def load_converted(model: str, trust_remote_code: bool):
    """A converted model (directory or Hub id) through AutoModelForCausalLM, as users load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_argument(model, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
        loaded = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True, dtype=torch.float32)
    except Exception as err:  # huggingface_hub, transformers and the remote code raise many types
        raise HfcompressError(
            f"Cannot load {model} ({type(err).__name__}: {_first_line(err)}): pass a directory written by "
            "`hfcompress convert` or the Hub id it was pushed to."
        ) from err
    return loaded.eval(), tokenizer


def check_model_argument(model: str, trust_remote_code: bool) -> None:
    """Refuse, before any model loads, a MODEL that is missing, a file, a directory that holds no model, or a
    directory or Hub id that is not an hfcompress output when --trust-remote-code is not given."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / REPORT_FILE).is_file():
            return
        if not (path / "config.json").is_file():
            raise HfcompressError(
                f"{model} holds no model (no config.json): pass a directory written by `hfcompress convert`."
            )
        if not trust_remote_code:
            config = read_json_object(path / "config.json")
            if "auto_map" in config:
                raise HfcompressError(
                    f"{model} is not an hfcompress output (no {REPORT_FILE}): pass a directory written by `hfcompress "
                    "convert`, or add --trust-remote-code to run the modeling code this one ships (config.json's auto_map)."
                )
            raise HfcompressError(
                f"{model} is not an hfcompress output (no {REPORT_FILE}) but a plain '{config.get('model_type')}' model "
                f"that ships no code: evaluate it beside a converted model, `hfcompress eval CONVERTED --baseline {model}`."
            )
        return
    if path.exists():
        raise HfcompressError(f"{model} is a file: pass a directory written by `hfcompress convert`.")
    if not looks_like_repo_id(model):
        raise HfcompressError(
            f"{model} does not exist: pass a directory written by `hfcompress convert`, or a Hub id (user/name)."
        )
    if not trust_remote_code:
        raise HfcompressError(
            f"{model} is not a local directory; as a Hub id it runs the modeling code its repo ships: add "
            "--trust-remote-code to allow that."
        )


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
    lm_eval: LmEvalOptions | None = None,
    command: str = "",
    engine: str = "transformers",
    kv_cache_dtype: str | None = None,
) -> dict:
    models = {}
    if context < 2 or (stride is not None and not 0 < stride <= context):  # less a BOS: checked once the tokenizer loads
        raise HfcompressError(
            f"--context must be at least 2 tokens and --stride in 1..--context, got --context {context} --stride {stride}."
        )
    if kv_cache_dtype is not None and engine != "vllm":  # the transformers path has no such cache option
        raise HfcompressError(f"--kv-cache-dtype {kv_cache_dtype} sets vLLM's KV cache: use it with --engine vllm.")
    check_model_argument(model_name, trust_remote_code)  # a missing or plain directory: before anything loads
    if engine not in ("transformers", "vllm"):
        raise HfcompressError(f"--engine must be transformers or vllm, got {engine!r}.")
    if engine == "vllm":  # vLLM's environment exists and serves this model: before anything loads
        from ..serving.vllm_engine import check_vllm_environment, vllm_python

        check_vllm_environment(vllm_python(), model_name)
    check_text_option(eval_text, "evaluation")  # a bad text option fails before any model loads
    check_text_option(ood_text, "other-domain")
    report_path = Path(model_name) / REPORT_FILE
    saved_report = json.loads(report_path.read_text()) if report_path.is_file() else None
    baseline_source = None
    if baseline:
        baseline_source = resolve_source(baseline)
    elif lm_eval is not None and saved_report is not None:  # lm-eval always compares with the original
        baseline_source = original_of(saved_report["source"], Path(model_name))
    elif lm_eval is not None:
        raise HfcompressError(f"{model_name} is not a local hfcompress output: pass --baseline SOURCE to compare lm-eval results with.")
    converted, tokenizer = load_converted(model_name, trust_remote_code)
    baseline_tokenizer = None
    if baseline_source is not None:
        models["baseline"], baseline_tokenizer = load_source(baseline_source)
    models["model"] = converted
    # "auto" texts as the conversion read them: offline for a model converted from a local source (and a local or no
    # baseline); a Hub source's conversion read the online mixture where the Hub answered, and so does its eval
    converted_from_hub = bool(saved_report) and (saved_report.get("source") or {}).get("kind") == "hub"
    local = is_local_source(model_name) and not converted_from_hub and (baseline is None or is_local_source(baseline))
    with local_source_texts() if local else nullcontext():
        ids, text_name = evaluation_ids(tokenizer, load_text(eval_text, "evaluation"))
        calibration = saved_report["calibration"]["text"] if saved_report else ""
        other = other_domain_ids(tokenizer, ood_text, calibration)
    prefix = window_prefix(tokenizer)  # the windows convert scored: [BOS] first where the tokenizer adds one
    result: dict = {"eval_text": text_name, "other_domain_text": other[1] if other else None, "models": {}}
    for name, model in models.items():
        if name == "model" and engine == "vllm":  # the served model's prompt log-probs (hfcompress.serving.vllm_engine)
            from ..serving.vllm_engine import vllm_perplexities

            texts = [ids, *([other[0]] if other else [])]
            kv = kv_cache_dtype or "auto"
            served = vllm_perplexities(model_name, texts, context, stride, eval_tokens, prefix, kv_cache_dtype=kv)
            entry = {"engine": "vllm", "kv_cache_dtype": kv, "perplexity": served[0].to_dict()}
            if other:
                entry["other_domain_perplexity"] = served[1].to_dict()
        else:
            entry = {"perplexity": perplexity(model, ids, context, stride, eval_tokens, label=f"perplexity: {name}", prefix=prefix).to_dict()}
        if other and "other_domain_perplexity" not in entry:
            entry["other_domain_perplexity"] = perplexity(
                model, other[0], context, stride, eval_tokens, label=f"perplexity: {name}, other domain", prefix=prefix
            ).to_dict()
        if probe:
            entry["probe"] = {k: v for k, v in run_probe(model, tokenizer).to_dict().items() if k != "per_fact"}
        result["models"][name] = entry
    if speed:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        prompt = ids[:512].unsqueeze(0).to(device)
        for model in models.values():
            model.to(device)
        measured, noise = compare_speed(models, prompt)
        for name, figures in measured.items():
            result["models"][name]["speed"] = figures.to_dict()
        result["speed_noise"] = noise  # trusted or not, and why: untrusted figures are no result
        result["device"] = str(device)
    if lm_eval is not None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        result["lm_eval"] = {
            **run_lm_eval(
                (model_name, converted, tokenizer), (baseline_source.name, models["baseline"], baseline_tokenizer), lm_eval, device
            ),
            "command": command,
        }
        if saved_report is not None:  # into the output's record and card, beside the conversion's own evidence
            saved_report["lm_eval"] = result["lm_eval"]
            report_path.write_text(json.dumps(saved_report, indent=2, default=str))
            write_card(saved_report, ModelCard.load(Path(model_name) / "README.md").data.model_name or Path(model_name).name, Path(model_name))
            console.log(f"lm-eval results written into {report_path} and {Path(model_name) / 'README.md'}")

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
    if speed and not result["speed_noise"]["trusted"]:
        console.print(f"[yellow]The tok/s columns are not trusted: {'; '.join(result['speed_noise']['reasons'])}.[/]")
    if lm_eval is not None:
        console.print(lm_eval_table(result["lm_eval"]))
    return result


def original_of(source: dict, model_dir: Path) -> ResolvedSource:
    """The source a conversion recorded in its report, resolved again (a Hub source at the recorded commit). A local
    source is recorded by its directory name only (no local path leaves the machine), so it is looked for in the
    current directory, then beside the converted model `model_dir` (convert's usual layout: `--out` next to it)."""
    if source["kind"] == "hub":
        return resolve_source(source["repo_id"], revision=source.get("commit_sha") or source.get("revision"))
    if source["name"] == BUILTIN_SOURCE:
        return resolve_source(BUILTIN_SOURCE)
    recorded = Path(source["path"]) / source["gguf_file"] if source.get("gguf_file") else Path(source["path"])
    candidates = [recorded, model_dir.parent / recorded]  # an absolute path (an older report) is the same in both
    path = next((candidate for candidate in candidates if candidate.exists()), None)
    if path is None:
        raise HfcompressError(
            f"The original model {recorded} that the report records is neither in the current directory nor beside "
            f"{model_dir}: pass it with --baseline PATH (or a Hub id) to compare with it."
        )
    return resolve_source(str(path))


def lm_eval_table(section: dict) -> Table:
    table = Table(title=f"lm-eval {section['lm_eval_version']} (batch size {section['settings']['batch_size']})")
    for column in ("task", "metric", "original", "converted"):
        table.add_column(column)
    for row in section["rows"]:
        original = "-" if row["original"] is None else f"{row['original']:.4g}"
        table.add_row(row["task"], row["metric"], original, f"{row['converted']:.4g}")
    return table
