"""Step 7, card: README.md for the converted repo from the Jinja template in cards/, through huggingface_hub.

The card follows the Hub's conventions: the licence (and language) the source declares, with the source's licence
files copied next to the weights; `base_model` with its relation; a model-index of this model's own results on Hub
datasets only (id, config, split, revision), so the Hub can link them; `datasets:` for Hub calibration data. The
original model's figures, and texts the Hub cannot link (the built-in text, the news corpus, files), are in the
card's tables only. `render_card(report, repo_id)` needs nothing but the report, so the card of an existing output
directory can be rendered again from its updated `hfcompress_report.json`.
"""

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..families import FAMILIES
from .peers import perplexities_on
from ..remote import cards_dir
from ..sources.source import LICENCE_FILE_PREFIXES, gguf_header_strings  # file names starting so (any case) are licence files

TEMPLATE = "model_card.md.j2"
LICENCE_FILE_WORDS = ("TERMS",)  # or containing so (GEMMA_TERMS.html)
NOTICE_FILE = "NOTICE"


@dataclass(frozen=True)
class CustomLicence:
    """A Hub licence id whose terms are not an SPDX licence, and what they ask of a redistributed derivative."""

    name: str
    link: str
    notice: str  # the line the terms require in a "Notice" text file shipped with the model
    terms_marker: str  # a phrase of the terms' own text: a copied file containing it is a copy of the terms


# Gemma Terms of Use, section 3.1: a redistributed Gemma Model Derivative carries a copy of the terms, a notice that
# it was modified, and this line in a "Notice" text file.
CUSTOM_LICENCES = {
    "gemma": CustomLicence(
        name="Gemma Terms of Use",
        link="https://ai.google.dev/gemma/terms",
        notice="Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms",
        terms_marker="Gemma Terms of Use",
    ),
}
# The Hub's four relations are adapter, merge, quantized and finetune. This model is none of the first three: its
# weights are complete (no adapter to load on top of the base), derived from one model (no merge), and not a
# lower-precision encoding of the base weights (quantized): layers lose their Q/K projections, linears are refactored
# into low-rank products, and new parameters are fitted and distilled on data. Weights derived from the base by
# training are what `finetune` means; stating it also keeps the Hub from guessing from the files.
BASE_MODEL_RELATION = "finetune"
LM_EVAL_NAME, LM_EVAL_URL = "lm-evaluation-harness", "https://github.com/EleutherAI/lm-evaluation-harness"
# `datasets` loaders that read local or given files: an lm-eval dataset_path naming one is not a Hub dataset
PACKAGED_BUILDERS = {
    "arrow", "audiofolder", "cache", "csv", "eval", "generator", "hdf5", "imagefolder", "json", "lance", "niftifolder",
    "pandas", "parquet", "pdffolder", "spark", "sql", "text", "videofolder", "webdataset", "xml",
}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# llama.cpp's quantisation type at the end of a GGUF file name: SmolLM2-135M-Instruct.Q4_1.gguf, x-Q4_K_M.gguf, x.f16.gguf
GGUF_QUANT = re.compile(r"[.\-_]((?:IQ|Q|TQ)\d[A-Z0-9_]*|BF16|F16|F32)\.gguf$", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------------- licence
def is_licence_file(name: str) -> bool:
    upper = name.upper()
    return upper.startswith(LICENCE_FILE_PREFIXES) or any(word in upper for word in LICENCE_FILE_WORDS)


def licence_files(directory: Path) -> list[Path]:
    """The licence files in a model directory (LICENSE*, LICENCE*, NOTICE*, USE_POLICY*, *TERMS*, any case), top
    level only. Files, not directories; a Hub snapshot's files are links into the cache, so links to files count."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if is_licence_file(p.name) and p.is_file())


def _gguf_licence(path: Path) -> dict:
    """license, license_name, license_link, language from a GGUF's metadata (general.*), read from its header alone."""
    keys = {"license": "general.license", "license_name": "general.license.name", "license_link": "general.license.link",
            "language": "general.languages"}
    values = gguf_header_strings(path, set(keys.values()), stop_after="tokenizer.ggml.model")
    return {field: values.get(key) for field, key in keys.items()}


def declared_licence(source: dict) -> tuple[dict, str | None, str | None]:
    """(license/license_name/license_link/language the source declares, where, why none) for a report's source."""
    fields = {"license": None, "license_name": None, "license_link": None, "language": None}
    directory = Path(source["path"])
    if source.get("gguf_file"):
        where = f"the GGUF metadata of {source['gguf_file']}"
        try:
            fields.update(_gguf_licence(directory / source["gguf_file"]))
        except Exception as err:  # gguf raises many kinds on a damaged file: the card then says it is unknown
            return fields, None, f"{where} could not be read ({type(err).__name__})"
        return fields, where, None if fields["license"] else f"{where} has no general.license"
    readme = directory / "README.md"
    if not readme.is_file():
        return fields, None, "the source has no model card (README.md)"
    where = "the source's model card (README.md)"
    try:
        data = ModelCard.load(readme, ignore_metadata_errors=True).data
    except Exception as err:  # a card whose YAML does not parse: its licence is unknown, not a failed conversion
        return fields, None, f"{where} could not be parsed ({type(err).__name__})"
    fields.update({key: data.get(key) for key in fields})
    return fields, where, None if fields["license"] else f"{where} declares no license"


def carry_licence(source: dict, directory: Path, extra_files: list[Path] = ()) -> dict:
    """Copy the source's licence files, and `extra_files` (--licence-file), into `directory`; the record of the licence
    the card states (report.licence). For a custom licence hfcompress knows (CUSTOM_LICENCES: Gemma's), its name and
    link fill what the source leaves out, and the notice its terms require is written into NOTICE.

    Keys: license, license_name, license_link, language (as the source declares them, or None), declared_in (where
    they were read), unknown_because (why there is no licence), files (the names copied or written), notice (the
    required notice line, or None), terms_copied (whether a copy of those terms is among the files; None when the
    licence asks for none)."""
    fields, where, why_not = declared_licence(source)
    directory = Path(directory)
    copied: list[str] = []
    for path in [*licence_files(Path(source["path"])), *map(Path, extra_files)]:
        shutil.copyfile(path, directory / path.name)  # the content, also when the snapshot file is a link
        if path.name not in copied:
            copied.append(path.name)
    link = fields["license_link"]
    if link and "://" not in link and link.removeprefix("./") not in copied:  # a link relative to the source repo, to a file not copied
        repo, commit = source.get("repo_id"), source.get("commit_sha") or source.get("revision")
        fields["license_link"] = f"https://huggingface.co/{repo}/blob/{commit}/{link}" if repo and commit else None
    notice, terms_copied = None, None
    custom = CUSTOM_LICENCES.get(str(fields["license"]).lower())
    if custom is not None:
        fields["license_name"] = fields["license_name"] or custom.name
        fields["license_link"] = fields["license_link"] or custom.link
        notice = custom.notice
        texts = {name: (directory / name).read_text(errors="replace") for name in copied}
        terms_copied = any(custom.terms_marker in text for name, text in texts.items() if name != NOTICE_FILE)
        existing = texts.get(NOTICE_FILE, "")
        if notice not in existing:
            (directory / NOTICE_FILE).write_text(existing + ("\n" if existing and not existing.endswith("\n") else "") + notice + "\n")
            if NOTICE_FILE not in copied:
                copied.append(NOTICE_FILE)
    return {**fields, "declared_in": where, "unknown_because": why_not, "files": sorted(copied), "notice": notice,
            "terms_copied": terms_copied}


# ------------------------------------------------------------------------------------------------- model-index
def is_hub_dataset_id(path: str | None) -> bool:
    """Whether an lm-eval dataset_path names a Hub dataset (owner/name, or a legacy bare name), not a local loader."""
    if not path or path.lower() in PACKAGED_BUILDERS or path.startswith((".", "/", "~")) or Path(path).exists():
        return False
    return bool(HUB_ID.match(path))


def _perplexity_results(texts: list[dict]) -> list[EvalResult]:
    """This model's perplexity on each evaluation text that is a Hub dataset split (others cannot be linked)."""
    results = []
    for row in texts:
        dataset = row.get("dataset")
        if not dataset:
            continue
        converted = row["converted"]
        results.append(EvalResult(
            task_type="text-generation",
            dataset_type=dataset["id"],
            dataset_name=row["eval_text"],
            dataset_config=dataset.get("config"),
            dataset_split=dataset.get("split"),
            dataset_revision=dataset.get("revision"),
            metric_type="perplexity",
            metric_value=round(converted["perplexity"], 4),
            metric_name="Perplexity",
            metric_args={"context": converted["context"], "stride": converted["stride"], "tokens": converted["tokens"]},
        ))
    return results


def _lm_eval_results(lm_eval: dict) -> list[EvalResult]:
    """This model's lm-evaluation-harness scores on tasks whose dataset is on the Hub."""
    fewshot = lm_eval["settings"].get("num_fewshot")
    results = []
    for row in lm_eval["rows"]:
        if row.get("converted") is None or not is_hub_dataset_id(row.get("dataset_path")):
            continue
        results.append(EvalResult(
            task_type="text-generation",
            dataset_type=row["dataset_path"],
            dataset_name=row["task"] + (f" ({fewshot}-shot)" if fewshot is not None else ""),
            dataset_config=row.get("dataset_name"),
            dataset_split=row.get("split"),
            dataset_args={"num_few_shot": fewshot} if fewshot is not None else None,
            metric_type=row["metric"].split(",")[0],  # lm-eval's "acc,none": the metric, then its filter
            metric_value=round(row["converted"], 4),
            metric_name=f"{row['task']} {row['metric']}",  # results of two tasks on one dataset are grouped by the Hub
            source_name=LM_EVAL_NAME,
            source_url=LM_EVAL_URL,
        ))
    return results


# ---------------------------------------------------------------------------------------------- lm-eval section
def _score(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr else "")


def _change(original: float | None, converted: float | None) -> str:
    if original is None or converted is None:
        return "–"
    relative = f" ({100 * (converted - original) / abs(original):+.1f}%)" if original else ""
    return f"{converted - original:+.4f}{relative}"


def _limit(limit) -> str:
    if limit is None:
        return "every example"
    if isinstance(limit, float) and limit < 1:
        return f"{100 * limit:g}% of each task's examples"
    return f"the first {int(limit):,} examples of each task"


def lm_eval_view(lm_eval: dict | None) -> dict | None:
    """The lm-evaluation-harness record (report["lm_eval"], from `hfcompress eval --lm-eval`) as the card shows it."""
    if not lm_eval:
        return None
    settings = lm_eval.get("settings", {})
    fewshot = settings.get("num_fewshot")
    rows = []
    for row in lm_eval["rows"]:
        better = row.get("higher_is_better")
        rows.append({
            "task": row["task"],
            "metric": row["metric"] + ("" if better is None else " ↑" if better else " ↓"),
            "original": _score(row.get("original"), row.get("original_stderr")),
            "converted": _score(row.get("converted"), row.get("converted_stderr")),
            "change": _change(row.get("original"), row.get("converted")),
        })
    return {
        "version": lm_eval.get("lm_eval_version"),
        "command": lm_eval.get("command"),
        "original": lm_eval.get("original"),
        "rows": rows,
        "batch_size": settings.get("batch_size"),
        "fewshot": "each task's default" if fewshot is None else str(fewshot),
        "limit": _limit(settings.get("limit")),
        "device": settings.get("device"),
        "dtype": settings.get("dtype"),
    }


# ------------------------------------------------------------------------------------------------------- card
def original_loaded(source: dict) -> dict | None:
    """What the conversion's "original" was as loaded, when it is not the weights `base_model` names: a dequantised
    GGUF, named by its file and its quantisation type (from the file name). {description, short}, or None."""
    name = source.get("gguf_file")
    if not name:
        return None
    match = GGUF_QUANT.search(name)
    quant = match[1].upper() if match else None
    unknown = "" if quant else " (its quantisation type is not in its file name)"
    of = f" of `{source['base_model']}`" if source.get("base_model") else ""
    return {
        "description": f"the {quant + ' ' if quant else ''}GGUF file `{name}`{unknown}{of}, dequantised to float32 by hfcompress",
        "short": f"dequantised {quant + ' ' if quant else ''}GGUF",
    }


def peers_view(report: dict) -> dict | None:
    """The trade-off table: the original, this conversion and the training-free peers (peers.py), each with its KV
    cache a token relative to the original and its perplexity on every gated text; None when they were not computed, or
    the conversion saves no KV cache (then there is nothing to compare at its saving)."""
    peers = report.get("peers")
    if not peers or peers["kv_values_per_token"]["converted"] >= peers["kv_values_per_token"]["original"]:
        return None
    texts = report["validation"]["texts"]
    values = peers["kv_values_per_token"]
    speed = report.get("speed") or {}
    timed = speed.get("peers") or {}  # decode speed of the peers the speed run timed (peers.speed_peers)
    untrusted = "; ".join(speed["noise"]["reasons"]) if timed and speed.get("trusted") is False else None
    shown = {} if untrusted else timed  # noise is no result: the decode column shows none, and the card says why
    rows = [
        {"name": "original", "kv_ratio": 1.0, "perplexity": [t["original"]["perplexity"] for t in texts],
         "decode": 1.0 if shown else None},
        {"name": "**this conversion**", "kv_ratio": values["converted"] / values["original"],
         "perplexity": [t["converted"]["perplexity"] for t in texts], "decode": speed.get("decode_speedup") if shown else None},
    ]  # fmt: skip
    for peer in peers["peers"]:
        layers = f" (layers {', '.join(map(str, peer['layers']))})" if peer["layers"] else ""
        decode = shown[peer["name"]]["decode_speedup"] if peer["name"] in shown else None
        rows.append({"name": peer["name"] + layers, "kv_ratio": peer["kv_ratio"], "perplexity": perplexities_on(peer, texts), "decode": decode})
    frontier = [
        {"name": point["name"], "kv_ratio": point["kv_ratio"], "perplexity": perplexities_on(point, texts),
         "dropped": point["dropped_attention_layers"]}
        for point in sorted(peers.get("frontier") or [], key=lambda point: -point["kv_ratio"])
    ]  # fmt: skip
    return {
        "texts": [t["eval_text"].split(" (")[0] for t in texts],
        "frontier": frontier,
        "own_budget": (report.get("keys") or {}).get("kv_budget"),
        "timed": bool(timed),
        "untrusted_speed": untrusted,
        "rows": rows,
        "dominated_by": peers.get("dominated_by") or [],
        "skipped": peers.get("skipped"),
    }


def render_card(report: dict, repo_id: str) -> ModelCard:
    """The model card of a conversion, from its report (hfcompress_report.json; see report.py and pipeline.py)."""
    source = report["source"]
    validation = report["validation"]
    lisa = report.get("lisa") or {"layers": [], "similarity": [], "fitted": []}
    fasc = report.get("fasc") or {"layers": []}
    distill = report.get("finishers", {}).get("distillation")
    licence = report.get("licence") or {}
    texts = validation.get("texts") or [validation]
    similarity = {row["layer"]: row for row in lisa["similarity"]}
    fasc_layers = [r for r in fasc["layers"] if r.get("rank") is not None]
    keys = report.get("keys") or {"layers": []}
    key_layers = [row for row in keys["layers"] if row.get("action", "keys") == "keys" and row["rank"] < row["width"]]
    value_layers = [row for row in keys["layers"] if row.get("value_rank", row["width"]) < row["width"]]
    latent_layers = [row for row in keys["layers"] if row in key_layers or row in value_layers]
    calibration_dataset = report.get("calibration", {}).get("dataset")  # one Hub dataset split: the card links it
    # every Hub dataset the calibration text read (a mixture's Hub domains too); reports before the list have the one
    calibration_datasets = report.get("calibration", {}).get("datasets") or ([calibration_dataset] if calibration_dataset else [])
    lm_eval = report.get("lm_eval")
    eval_results = _perplexity_results(texts) + (_lm_eval_results(lm_eval) if lm_eval else [])
    base_model = source.get("base_model")
    family = FAMILIES[source.get("family", "llama")]  # reports from before the families are all Llama
    card_data = ModelCardData(
        base_model=base_model,
        base_model_relation=BASE_MODEL_RELATION if base_model else None,
        license=licence.get("license"),
        license_name=licence.get("license_name"),
        license_link=licence.get("license_link"),
        language=licence.get("language") or None,
        datasets=list(dict.fromkeys(d["id"] for d in calibration_datasets)) or None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["hfcompress", *(["lisa"] if lisa["layers"] else []), *(["fasc"] if fasc_layers else []),
              *(["low-rank-keys"] if key_layers else []), *(["low-rank-values"] if value_layers else []),
              *(["distillation"] if distill else []), "custom_code", family.name],
        model_name=repo_id if eval_results else None,  # the model-index's name; without one it would be a YAML key
        eval_results=eval_results or None,
    )
    card = ModelCard.from_template(
        card_data,
        template_path=str(cards_dir() / TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model_name=source["name"],
        base_model=base_model,
        original_loaded=original_loaded(source),
        architecture=family.causal_lm_class,
        modeling_file=f"{family.modeling_module}.py",
        gate_failed=not validation["gate_passed"],
        gate_message=validation["gate_message"],
        ppl_context=validation["converted"]["context"],
        texts=texts,
        in_model_index=[row["eval_text"] for row in texts if row.get("dataset")],
        max_ppl_increase=validation["max_ppl_increase_pct"],
        distill=distill,
        calibration=report.get("calibration", {}),
        calibration_dataset=calibration_dataset,
        params_original=report["parameters"]["original"],
        params_converted=report["parameters"]["converted"],
        reload_diff=(validation.get("reload") or {}).get("max_abs_logit_diff"),
        plots=report.get("plots", {}),
        probe=validation.get("probe", {}),
        num_layers=report["num_layers"],
        lisa_layers=lisa["layers"],
        lisa_rank=lisa.get("rank"),
        lisa_grouped_keys=(lisa.get("options") or {}).get("lowrank_keys") == "group",
        qk_compression=lisa.get("qk_compression_measured"),
        lisa_table=[{**similarity.get(f["layer"], {}), **f} for f in lisa["fitted"]],
        fasc_layers=fasc_layers,
        keys=keys,
        key_layers=key_layers,
        value_layers=value_layers,
        kv_plan=keys.get("chosen_plan", keys.get("plan")),
        latent_layers=latent_layers,
        key_width=latent_layers[0]["width"] if latent_layers else None,
        fasc_targeted=len(fasc["layers"]),
        fasc_method=fasc.get("method"),
        fasc_budget=fasc.get("budget"),
        licence=licence,
        lm_eval=lm_eval_view(lm_eval),
        command=report["command"],
        source_name=source["name"],
        source_commit=source.get("commit_sha"),
        hfcompress_version=report["versions"]["hfcompress"],
        transformers_version=report["versions"]["transformers"],
        torch_version=report["versions"]["torch"],
        wall_seconds=report["wall_seconds"],
        hardware=report["hardware"],
        speed=report.get("speed"),
        dtype=report.get("dtype", "float32"),
        dropped_layers=sorted({*(lisa.get("dropped_attention_layers") or []), *(keys.get("dropped_attention_layers") or [])}),
        peers=peers_view(report),
        back_off=report.get("back_off") or [],
    )
    return ModelCard(re.sub(r"\n{3,}", "\n\n", card.content))  # the template's skipped sections leave blank runs


def write_card(report: dict, repo_id: str, directory: Path) -> None:
    # saved and uploaded with the folder: ModelCard.push_to_hub validates against huggingface.co only
    render_card(report, repo_id).save(Path(directory) / "README.md")
