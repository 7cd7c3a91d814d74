"""`hfcompress eval --lm-eval`: lm-evaluation-harness tasks on the original and the converted model, same settings.

Both models run through lm-eval's own `hf` backend (HFLM), as `lm_eval --model hf` runs them: the converted one as users
load it (`AutoModelForCausalLM` with `trust_remote_code=True`), the original with transformers' classes of its family (a
source's own code is never run).
The results, with lm-eval's version and settings, go into the output's report and card (`report["lm_eval"]`).
"""

import functools
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from ..errors import HfcompressError
from ..progress import console


@dataclass
class LmEvalOptions:
    tasks: list[str]
    include_path: Path | None = None  # a folder of task YAML files (local tasks, offline)
    batch_size: int = 1
    num_fewshot: int | None = None
    limit: float | None = None  # documents per task (< 1: a fraction), for quick runs

    @classmethod
    def parse(
        cls, tasks: str, include_path: Path | None, batch_size: int, num_fewshot: int | None, limit: float | None
    ) -> "LmEvalOptions":
        """Checked before any model loads: lm-eval installed, tasks known, numbers in range."""
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        if not names:
            raise HfcompressError("--lm-eval needs comma-separated lm-eval task names, e.g. --lm-eval wikitext,hellaswag.")
        if include_path is not None and not Path(include_path).is_dir():
            raise HfcompressError(f"--lm-eval-include {include_path} is not a directory of lm-eval task YAML files.")
        if batch_size < 1:
            raise HfcompressError(f"--lm-eval-batch-size must be >= 1, got {batch_size}.")
        if num_fewshot is not None and num_fewshot < 0:
            raise HfcompressError(f"--lm-eval-fewshot must be >= 0, got {num_fewshot}.")
        if limit is not None and limit <= 0:
            raise HfcompressError(f"--lm-eval-limit must be > 0 (documents per task, or a fraction below 1), got {limit}.")
        options = cls(names, Path(include_path) if include_path else None, batch_size, num_fewshot, limit)
        unknown = [t for t in names if t not in options.task_manager().all_tasks]
        if unknown:
            where = f" in lm-eval's tasks or {include_path}" if include_path else " in lm-eval's tasks (pass --lm-eval-include DIR for local task files)"
            raise HfcompressError(f"Unknown lm-eval task(s) {', '.join(unknown)}{where}: list them with `lm_eval ls tasks`.")
        return options

    def task_manager(self):
        return _task_manager(str(self.include_path) if self.include_path else None)


@functools.cache
def _task_manager(include_path: str | None):
    """lm-eval's task index (it scans thousands of task YAMLs: about 10 s, so once per process)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise HfcompressError("--lm-eval needs lm-evaluation-harness: pip install 'hfcompress[eval]' (or lm-eval==0.4.13).") from err
    return TaskManager(include_path=include_path)


def _evaluate(model, options: LmEvalOptions, label: str) -> dict:
    """lm-eval's `simple_evaluate` of one model (an HFLM) on the tasks: its results dict."""
    from lm_eval import simple_evaluate

    console.log(f"lm-eval: {label} on {', '.join(options.tasks)}")
    results = simple_evaluate(
        model=model, tasks=options.tasks, num_fewshot=options.num_fewshot, batch_size=options.batch_size,
        limit=options.limit, task_manager=options.task_manager(), log_samples=False,
    )
    if results is None:  # only on non-zero ranks of a distributed run
        raise HfcompressError("lm-eval returned no results: run `hfcompress eval` as a single process.")
    return results


def _metrics(results: dict) -> dict[tuple[str, str], tuple[float, float | None]]:
    """(task, metric) -> (value, stderr or None) from lm-eval's results, for every numeric metric."""
    table = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or not isinstance(value, int | float):
                continue
            stderr = values.get(f"{metric}_stderr,{filter_name}")
            name = metric if filter_name == "none" else f"{metric} ({filter_name})"
            table[(task, name)] = (float(value), float(stderr) if isinstance(stderr, int | float) else None)
    return table


def run_lm_eval(converted, original, options: LmEvalOptions, device: str) -> dict:
    """The same lm-eval tasks on the converted and the original model, each `(name, model, tokenizer)` (the original
    may be None): the card's `lm_eval` section (see cards/model_card.md.j2)."""
    from lm_eval.models.huggingface import HFLM

    settings = {"batch_size": options.batch_size, "num_fewshot": options.num_fewshot, "limit": options.limit,
                "device": device, "dtype": "float32"}  # fmt: skip
    measured = {}
    for label, entry in (("converted", converted), ("original", original)):
        if entry is not None:
            name, model, tokenizer = entry
            backend = HFLM(pretrained=model.float().to(device), tokenizer=tokenizer, batch_size=options.batch_size)
            measured[label] = _evaluate(backend, options, f"{label} model {name}")
    converted_metrics = _metrics(measured["converted"])
    original_metrics = _metrics(measured["original"]) if "original" in measured else {}
    configs, better = measured["converted"]["configs"], measured["converted"]["higher_is_better"]
    rows = []
    for (task, metric), (value, stderr) in converted_metrics.items():
        config = configs.get(task, {})
        base = original_metrics.get((task, metric))
        rows.append({
            "task": task, "metric": metric, "converted": value, "converted_stderr": stderr,
            "original": base[0] if base else None, "original_stderr": base[1] if base else None,
            "dataset_path": config.get("dataset_path"), "dataset_name": config.get("dataset_name"),
            "split": config.get("test_split") or config.get("validation_split"),
            "higher_is_better": better.get(task, {}).get(metric.split(" (")[0]),
            "version": measured["converted"]["versions"].get(task),
        })  # fmt: skip
    return {
        "lm_eval_version": importlib.metadata.version("lm-eval"),
        "settings": settings,
        "original": original[0] if original is not None else None,
        "converted": converted[0],
        "rows": rows,
    }
