"""Step 7, card: README.md for the converted repo from the Jinja template in cards/, through huggingface_hub."""

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .remote import cards_dir

TEMPLATE = "model_card.md.j2"


def _perplexity_result(validation: dict, model: str, name: str) -> EvalResult:
    return EvalResult(
        task_type="text-generation",
        dataset_type="text",
        dataset_name=validation["eval_text"],
        metric_type="perplexity",
        metric_value=round(validation[model]["perplexity"], 4),
        metric_name=name,
    )


def render_card(report: dict, repo_id: str) -> ModelCard:
    """The model card of a conversion, from its report (see convert.py for the keys)."""
    source = report["source"]
    validation = report["validation"]
    lisa = report["lisa"]
    fasc = report["fasc"]
    similarity = {row["layer"]: row for row in lisa["similarity"]}
    card_data = ModelCardData(
        base_model=source.get("base_model"),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["hfcompress", "lisa", "fasc", "custom_code", "llama"],
        model_name=repo_id,
        eval_results=[
            _perplexity_result(validation, "converted", "Perplexity (converted)"),
            _perplexity_result(validation, "original", "Perplexity (original base model)"),
        ],
    )
    return ModelCard.from_template(
        card_data,
        template_path=str(cards_dir() / TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model_name=source["name"],
        gate_failed=not validation["gate_passed"],
        gate_message=validation["gate_message"],
        ppl_context=validation["converted"]["context"],
        texts=validation.get("texts") or [validation],
        max_ppl_increase=validation["max_ppl_increase_pct"],
        distill=report.get("finishers", {}).get("distillation"),
        params_original=report["parameters"]["original"]["total"],
        params_converted=report["parameters"]["converted"]["total"],
        reload_diff=validation["reload"]["max_abs_logit_diff"],
        plots=report.get("plots", {}),
        probe=validation.get("probe", {}),
        num_layers=report["num_layers"],
        lisa_layers=lisa["layers"],
        lisa_rank=lisa["rank"],
        qk_compression=lisa["qk_compression_measured"] or 0.0,
        lisa_table=[{**similarity.get(f["layer"], {}), **f} for f in lisa["fitted"]],
        fasc_layers=[r for r in fasc["layers"] if r["rank"] is not None],
        fasc_method=fasc["method"],
        fasc_budget=fasc["budget"],
        fasc_table=[r for r in fasc["layers"] if r["rank"] is not None],
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
    )


def write_card(report: dict, repo_id: str, directory: Path) -> None:
    # saved and uploaded with the folder: ModelCard.push_to_hub validates against huggingface.co only
    render_card(report, repo_id).save(directory / "README.md")
