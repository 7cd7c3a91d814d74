"""Real English text for calibration and perplexity.

`--calib-text` / `--eval-text` take one of:

* `wikitext-2`: Salesforce/wikitext, config wikitext-2-raw-v1, through `datasets`. Calibration reads the train split,
  evaluation the test split (the standard protocol), lines joined with blank lines as in the HF perplexity guide.
* `builtin`: the CPython language reference shipped as `pydoc_data.topics` (~465 kB of English prose, offline; 84,830 SmolLM2 tokens in its first 75%).
  Calibration reads its first 75%, evaluation its held-out last 25%.
* `wiki`: 106 English Wikipedia articles (Anarchism, Autism, Albedo, Algorithm, ...; a 2013 dump excerpt that gensim
  ships as test data, `enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`), offline. The wikitext
  markup is stripped with mwparserfromhell; tables, image captions, categories and the reference/link sections at
  each article's end are dropped: 3.1 MB of prose, ~736k SmolLM2 tokens, so the anchors' calibration sizes (GPTQ's
  128 x 2,048) fit in it. Calibration reads its first 75%, evaluation its held-out last 25%.
* a FILE: UTF-8 text. As calibration text its first 75% is used; as evaluation text all of it.
* `hf:OWNER/NAME[:CONFIG]`: the `text` column of any `datasets` dataset on the Hub (train split for calibration,
  test split for evaluation), pinned to the commit the Hub names at load time.
* `auto` (the default): wikitext-2 when the Hub answers, else `wiki` (the same kind of text, offline; `builtin` where
  gensim or mwparserfromhell is missing); for evaluation: the held-out last 25% of the calibration text. Calibration
  never sees the text perplexity is measured on. What the calibration text costs on other text, measured: README,
  "Calibration and evaluation text".

`--ood-text` names a second evaluation text of another domain than calibration, scored whole:
* `news` (what `auto` picks when it is installed): 300 ABC news articles, the background corpus of Lee, Pincombe and
  Welsh (2005) that gensim ships as test data (`gensim/test/test_data/lee_background.cor`, ~78k SmolLM2 tokens;
  `scripts/install.sh` installs the gensim wheel without its dependencies, only for this file, which is read, never
  imported). News prose shares neither vocabulary nor register with the Python language reference.
* a FILE, `builtin`, `wikitext-2` (its test split), or `none`.
"""

import importlib.util
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch

from .atomic import atomic_file
from .errors import HfcompressError
from .progress import console

AUTO, BUILTIN, WIKI, WIKITEXT, NEWS, NONE = "auto", "builtin", "wiki", "wikitext-2", "news", "none"
DATASET_PREFIX = "hf:"  # hf:REPO[:CONFIG], any `datasets` text dataset on the Hub
BUILTIN_TEXT_NAME = "python-language-reference (pydoc_data.topics)"
NEWS_TEXT_NAME = "lee-news (Lee et al. 2005 background corpus, 300 ABC news articles; gensim test data)"
GENSIM_DISTRIBUTION, NEWS_FILE = "gensim", "gensim/test/test_data/lee_background.cor"
WIKI_TEXT_NAME = "enwiki-sample (106 Wikipedia articles, a 2013 dump excerpt; gensim test data)"
WIKI_FILE = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# headings after which a Wikipedia article is lists of references and links, not prose
WIKI_END_SECTIONS = ("References", "External links", "See also", "Further reading", "Notes", "Bibliography", "Sources")
HELD_OUT_FRACTION = 0.25
WIKITEXT_REPO, WIKITEXT_CONFIG = "Salesforce/wikitext", "wikitext-2-raw-v1"
PROBE_TIMEOUT_S = 3.0  # "auto" asks the Hub once with this timeout, so a machine without network falls back at once
# wikitext-2 train is ~11 MB; calibration needs only its first tokens, and no tokenizer averages 16 characters a token
CHARS_PER_TOKEN_BOUND = 16

Role = Literal["calibration", "evaluation", "other-domain"]
_ROLES = {"calibration": ("--calib-text", "train"), "evaluation": ("--eval-text", "test"), "other-domain": ("--ood-text", "test")}


@dataclass(frozen=True)
class HubDataset:
    """Where a text came from when it is a split of a Hub dataset: what the card's model-index and `datasets:` name."""

    id: str  # owner/name on the Hub
    config: str | None
    split: str
    revision: str | None  # the commit loaded; None when read from the cache offline

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Text:
    """A named text. `held_out`: calibration reads its first 75% and evaluation its last 25% (no separate test split)."""

    name: str
    text: str
    held_out: bool
    dataset: HubDataset | None = None  # set for a Hub dataset split


# text name -> its Hub dataset, for every dataset split loaded in this process: the report records it next to the name
_HUB_DATASETS: dict[str, HubDataset] = {}


def hub_dataset(name: str) -> dict | None:
    """{id, config, split, revision} of the Hub dataset split a text of this report name was read from, else None
    (the built-in text, the news corpus and files are not Hub datasets)."""
    dataset = _HUB_DATASETS.get(name)
    return dataset.to_dict() if dataset else None


def builtin_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def gensim_data_file(relative: str) -> Path | None:
    """A data file of the installed gensim distribution (located, not imported), or None."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(distribution(GENSIM_DISTRIBUTION).locate_file(relative))
    except PackageNotFoundError:
        return None
    return path if path.is_file() else None


def news_file() -> Path | None:
    """The Lee news corpus file, or None without gensim."""
    return gensim_data_file(NEWS_FILE)


def wiki_file() -> Path | None:
    """The Wikipedia dump excerpt, or None without gensim."""
    return gensim_data_file(WIKI_FILE)


def wiki_article_prose(wikitext: str) -> str:
    """An article's prose: markup stripped, tables, image captions and categories dropped, cut at its first list
    section (references, external links, ...)."""
    import mwparserfromhell

    lines = []
    for line in mwparserfromhell.parse(wikitext).strip_code(normalize=True, collapse=True).splitlines():
        line = line.strip()
        if line in WIKI_END_SECTIONS:
            break
        if line.startswith(("|", "!", "{|", "Category:", "File:", "Image:")) or "thumb|" in line:  # tables, images
            continue
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def wiki_available() -> bool:
    return wiki_file() is not None and importlib.util.find_spec("mwparserfromhell") is not None


def offline_text() -> "Text":
    """What "auto" reads without the Hub: the Wikipedia excerpt (wikitext-2's domain), else the built-in text."""
    if wiki_available():
        return Text(WIKI_TEXT_NAME, wiki_text(), held_out=True)
    return Text(BUILTIN_TEXT_NAME, builtin_text(), held_out=True)


def text_cache_dir() -> Path:
    """Where parsed texts are cached: $HFCOMPRESS_TEXT_CACHE, else texts/ in the hfcompress cache directory. A parsed
    text depends on its source file only, so caches that are otherwise kept apart (the tests') can share it."""
    from .config import default_cache_dir

    return Path(os.environ["HFCOMPRESS_TEXT_CACHE"]) if os.environ.get("HFCOMPRESS_TEXT_CACHE") else default_cache_dir() / "texts"


def wiki_text() -> str:
    """The `wiki` text: every article (namespace 0, not a redirect) of the dump excerpt, in dump order. Parsing takes
    ~10 s, so the result is cached (`text_cache_dir`), keyed by the dump's size."""
    import bz2
    import xml.etree.ElementTree as ET

    source = wiki_file()
    if source is None:
        raise HfcompressError(
            f"'{WIKI}': the Wikipedia excerpt comes with the gensim wheel, which is not installed: run "
            "`pip install --no-deps gensim==4.4.0 mwparserfromhell`, or pass another text."
        )
    cached = text_cache_dir() / f"enwiki-sample-{source.stat().st_size}-v2.txt"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    root = ET.fromstring(bz2.decompress(source.read_bytes()))
    ns = root.tag.partition("}")[0] + "}"
    articles = [
        f"{page.findtext(ns + 'title')}\n\n{wiki_article_prose(page.findtext(f'{ns}revision/{ns}text') or '')}"
        for page in root.iter(ns + "page")
        if page.findtext(ns + "ns") == "0" and page.find(ns + "redirect") is None
    ]
    text = "\n\n".join(articles)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(cached) as partial:  # a reader never sees half a file
        partial.write_text(text, encoding="utf-8")
    return text


def read_text_file(path: Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise HfcompressError(f"Cannot read text file {path}: {err}.") from err
    if len(text.split()) < 200:
        raise HfcompressError(f"Text file {path} is too short: give at least a few thousand words.")
    return text


@lru_cache(maxsize=8)
def _probe_dataset(endpoint: str, repo: str = WIKITEXT_REPO) -> tuple[str | None, str | None]:
    """(commit sha of dataset `repo`, None) or (None, why it is unavailable): one request, bounded in time.

    Cached per endpoint and repo, so calibration and evaluation in one run ask once."""
    from huggingface_hub import HfApi

    try:
        # revision-qualified, as datasets' own downloads ask: a mirror may refuse the bare /api/datasets/{repo}
        info = HfApi(endpoint=endpoint).dataset_info(repo, revision="main", timeout=PROBE_TIMEOUT_S)
    except Exception as err:  # DNS, refused, timeout, 401/404: every failure means the same here
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status:
            return None, f"{endpoint} answered HTTP {status} for {repo}"
        return None, f"the Hub at {endpoint} is unreachable ({type(err).__name__})"
    return info.sha, None


def _dataset_revision(repo: str = WIKITEXT_REPO) -> tuple[str | None, str | None]:
    """(revision to load, None) or (None, why dataset `repo` cannot be loaded from the Hub now)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None, "HF_HUB_OFFLINE is set"
    if importlib.util.find_spec("datasets") is None:
        return None, "the datasets package is not installed"
    return _probe_dataset(constants.ENDPOINT, repo)


def _load_dataset(repo: str, config: str | None, split: str, revision: str | None) -> Text:
    """The `text` column of a `datasets` dataset split, rows joined with blank lines, named with its revision."""
    import datasets

    described = f"{repo} ({config + ', ' if config else ''}{split} split)"
    try:
        rows = datasets.load_dataset(repo, config, split=split, revision=revision)
    except Exception as err:  # datasets raises many kinds (connection, missing cache, bad files): one sentence for all
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HfcompressError(f"Cannot load {described}: {first_line}") from err
    if "text" not in rows.column_names:
        raise HfcompressError(f"{described} has no 'text' column (it has {', '.join(rows.column_names)}): choose a text dataset.")
    at = f" @{revision[:8]}" if revision else ""
    dataset = HubDataset(repo, config, split, revision)
    text = Text(f"{repo}{' ' + config if config else ''}, {split} split{at}", "\n\n".join(rows["text"]), False, dataset)
    _HUB_DATASETS[text.name] = dataset
    return text


def _load_wikitext(split: str, revision: str | None) -> Text:
    return _load_dataset(WIKITEXT_REPO, WIKITEXT_CONFIG, split, revision)


def _load_named_dataset(spec: str, role: Role) -> Text:
    """`hf:REPO[:CONFIG]`: calibration reads its train split, evaluation its test split."""
    from huggingface_hub import constants

    repo, _, config = spec.removeprefix(DATASET_PREFIX).partition(":")
    option, split = _ROLES[role]
    revision, reason = (None, None) if constants.HF_HUB_OFFLINE else _dataset_revision(repo)
    if reason is not None:
        raise HfcompressError(f"{option} {spec}: {reason}; check the network, or set HF_HUB_OFFLINE=1 to use a cached copy.")
    return _load_dataset(repo, config or None, split, revision)


def load_text(spec: str, role: Role, fallback: Text | None = None) -> Text:
    """The text `spec` names for `role`: a FILE path, "builtin", "wikitext-2" or "auto".

    "auto" is wikitext-2 when the Hub answers and the load works, else `fallback` (default: `offline_text()`), with
    one console line saying which and why."""
    option, split = _ROLES[role]
    if spec == AUTO:
        revision, reason = _dataset_revision()
        if reason is None:
            try:
                text = _load_wikitext(split, revision)
            except HfcompressError as err:
                reason = str(err)
            else:
                console.log(f"{role} text: {text.name} (auto: the Hub is reachable)")
                return text
        text = fallback or offline_text()
        console.log(f"{role} text: {part_name(text, role)} (auto: {reason})", highlight=False)
        return text
    if spec == BUILTIN:
        return Text(BUILTIN_TEXT_NAME, builtin_text(), held_out=True)
    if spec == WIKI:
        return Text(WIKI_TEXT_NAME, wiki_text(), held_out=True)
    if spec == WIKITEXT:
        from huggingface_hub import constants

        revision, reason = (None, None) if constants.HF_HUB_OFFLINE else _dataset_revision()  # offline: the cached copy
        if reason is not None:
            raise HfcompressError(
                f"{option} {WIKITEXT}: {reason}; check the network, set HF_HUB_OFFLINE=1 to use a cached copy, "
                f"or pass '{BUILTIN}' or a text file."
            )
        return _load_wikitext(split, revision)
    if spec.startswith(DATASET_PREFIX):
        return _load_named_dataset(spec, role)
    check_text_option(spec, role)
    return Text(str(spec), read_text_file(Path(spec)), held_out=role == "calibration")


def check_text_option(spec: str, role: Role) -> None:
    """Refuse a text option that is neither a text name nor an existing file (before any work)."""
    names = (NEWS, BUILTIN, WIKI, WIKITEXT, NONE, AUTO) if role == "other-domain" else (BUILTIN, WIKI, WIKITEXT, AUTO)
    if spec.startswith(DATASET_PREFIX):
        if not spec.removeprefix(DATASET_PREFIX).partition(":")[0].count("/") == 1:
            raise HfcompressError(f"{_ROLES[role][0]} '{spec}': write a Hub dataset as hf:owner/name or hf:owner/name:config.")
        return
    if spec not in names and not Path(spec).exists():
        raise HfcompressError(
            f"{_ROLES[role][0]} '{spec}' is neither a file nor a text name: give a UTF-8 text file, a Hub dataset "
            f"(hf:owner/name[:config]), {', '.join(repr(n) for n in names[:-1])} or {names[-1]!r}."
        )
    if spec == WIKI and not wiki_available():
        raise HfcompressError(
            f"{_ROLES[role][0]} {WIKI}: the Wikipedia excerpt needs the gensim wheel (its data file) and mwparserfromhell: "
            "run `pip install --no-deps gensim==4.4.0` and `pip install mwparserfromhell`, or pass another text."
        )
    if spec == NEWS and news_file() is None:
        raise HfcompressError(
            f"--ood-text {NEWS}: the news corpus comes with the gensim wheel, which is not installed: run "
            "`pip install --no-deps gensim==4.4.0`, or pass a text file or 'none'."
        )


def other_domain_ids(tokenizer, spec: str, calibration_name: str) -> tuple[torch.Tensor, str] | None:
    """(ids, name) of the other-domain evaluation text, scored whole; None for 'none' (or 'auto' without gensim)."""
    if spec == NONE or (spec == AUTO and news_file() is None):
        if spec == AUTO:
            console.log("other-domain text: none (auto: gensim, which carries the news corpus, is not installed)")
        return None
    if spec in (AUTO, NEWS):
        text = Text(NEWS_TEXT_NAME, news_file().read_text(encoding="utf-8"), held_out=False)
    elif spec == BUILTIN:
        text = Text(BUILTIN_TEXT_NAME, builtin_text(), held_out=False)
    elif spec == WIKI:
        text = Text(WIKI_TEXT_NAME, wiki_text(), held_out=False)
    elif spec == WIKITEXT or spec.startswith(DATASET_PREFIX):
        text = load_text(spec, "other-domain")
    else:
        text = Text(str(spec), read_text_file(Path(spec)), held_out=False)
    if calibration_name.startswith(text.name):
        raise HfcompressError(
            f"--ood-text is the calibration text ({text.name}): choose a text of another domain, e.g. '{NEWS}' or a file."
        )
    return tokenize(tokenizer, text.text), text.name


@dataclass
class TokenSplit:
    """Token ids of one text, cut into a calibration part and a held-out evaluation part."""

    name: str
    calibration: torch.Tensor  # 1-D int64
    held_out: torch.Tensor  # 1-D int64


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The text's ids without special tokens: windows cut from them get `window_prefix` in front."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def window_prefix(tokenizer) -> list[int]:
    """[BOS] when the tokenizer starts every text with it (Gemma, Llama 3: models trained so treat the first position
    as an attention sink, and score far worse without it), else [] (SmolLM2). Every window a model is calibrated,
    scored or distilled on starts with this prefix."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    ids = tokenizer("a")["input_ids"]
    return [bos] if ids and ids[0] == bos else []


def prefixed(prefix: list[int], ids: torch.Tensor) -> torch.Tensor:
    """`ids` (1-D, or 2-D rows) with `prefix` in front of each row."""
    if not prefix:
        return ids
    head = torch.tensor(prefix, dtype=ids.dtype)
    return torch.cat([head, ids]) if ids.dim() == 1 else torch.cat([head.expand(len(ids), -1), ids], dim=1)


def tokenize_split(tokenizer, text: str, name: str) -> TokenSplit:
    ids = tokenize(tokenizer, text)
    cut = int(len(ids) * (1 - HELD_OUT_FRACTION))
    return TokenSplit(name=name, calibration=ids[:cut], held_out=ids[cut:])


def part_name(text: Text, role: Role) -> str:
    """The report's name for the part of `text` that `role` reads."""
    if not text.held_out:
        return text.name
    return f"{text.name}, first 75%" if role == "calibration" else f"{text.name}, held-out last 25%"


def evaluation_ids(tokenizer, text: Text) -> tuple[torch.Tensor, str]:
    """(token ids scored for perplexity, their name for the report)."""
    ids = tokenize_split(tokenizer, text.text, text.name).held_out if text.held_out else tokenize(tokenizer, text.text)
    return ids, part_name(text, "evaluation")


def text_streams(
    tokenizer, calib_spec: str, eval_spec: str, calib_tokens: int
) -> tuple[torch.Tensor, str, torch.Tensor, str]:
    """(calibration ids (at least `calib_tokens` when the text has them), their name, evaluation ids, their name).

    An "auto" evaluation text that cannot be wikitext-2 is the held-out part of the calibration text."""
    calibration = load_text(calib_spec, "calibration")
    evaluation = load_text(eval_spec, "evaluation", fallback=calibration if calibration.held_out else None)
    if calibration.held_out:
        split = tokenize_split(tokenizer, calibration.text, calibration.name)
        calib_ids = split.calibration
        if evaluation == calibration:  # the common offline case: tokenise the text once
            return calib_ids, part_name(calibration, "calibration"), split.held_out, part_name(evaluation, "evaluation")
    else:
        calib_ids = tokenize(tokenizer, calibration.text[: calib_tokens * CHARS_PER_TOKEN_BOUND])
    eval_ids, eval_name = evaluation_ids(tokenizer, evaluation)
    return calib_ids, part_name(calibration, "calibration"), eval_ids, eval_name


def chunk(ids: torch.Tensor, seq_len: int, count: int | None = None) -> torch.Tensor:
    """Non-overlapping (count, seq_len) windows from the start of `ids`."""
    available = len(ids) // seq_len
    if available == 0:
        raise HfcompressError(f"The text has {len(ids)} tokens, fewer than one sequence of {seq_len}.")
    n = available if count is None else min(count, available)
    return ids[: n * seq_len].view(n, seq_len)
