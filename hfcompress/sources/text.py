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
* `mix`: a mixture of every real English domain the install carries, in equal shares: `wiki` (encyclopedic), the
  `news` corpus below, the Python language reference (`builtin`: a language's documentation) and 200 Usenet posts
  (alt.atheism and sci.space, 1993: conversational; the 20 Newsgroups sample gensim ships as test data). Each domain
  is split on its own: its first 75% is calibration text, its last 25% held out. The calibration parts are cut into
  512-token blocks, shuffled within each domain and interleaved in rounds (one block of every domain a round, the
  order drawn with --seed), so calibration sequences, the layer-selection text after them and distillation windows
  all come from every domain in equal shares; the held-out parts are interleaved the same way, in order and
  seed-independent, and are what evaluation scores. No held-out block is in any calibration step. gensim is a
  dependency, so a plain install has all four; without it the mixture is the Python language reference alone (said
  on the console and in the name, which lists the domains). `mix` never asks the Hub, online or not: it is the same
  text on every machine with the same install (the measured reference), and the way to keep a run off the network.
* a FILE: UTF-8 text. As calibration text its first 75% is used; as evaluation text all of it.
* `hf:OWNER/NAME[:CONFIG]`: the `text` column of any `datasets` dataset on the Hub (train split for calibration,
  test split for evaluation), pinned to the commit the Hub names at load time.
* `auto` (the default): when the Hub answers, the online mixture: the domains of `mix` plus two Hub domains, built the
  same way (equal shares, each domain split 75% / 25% on its own, the same interleave; evaluation scores the held-out
  part of every domain):
  - `wikitext-2`: the train split of Salesforce/wikitext wikitext-2-raw-v1 (Wikipedia's Good and Featured articles);
    its test split, the standard perplexity text, stays out of the mixture, so `--eval-text wikitext-2` is clean.
  - `c4`: English web pages, the text GPTQ calibrates on (allenai/c4), read as `datasets.load_dataset("allenai/c4",
    data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"}, split="validation")`. One validation shard
    because it is small (about 40 MB; the train shards GPTQ samples from are several times larger) and already the
    file GPTQ's code downloads for its C4 perplexity; the mixture starts after the shard's first 1,100 documents, the
    ones that C4 perplexity (GPTQ's and its followers') scores, so a converted model measured that way was not
    calibrated on them.
  Each Hub domain is pinned to the revision the Hub names at load time (in the domain's name, so the mixture's name in
  the report and the card says which; the calibration cache is keyed by the tokens themselves), read up to
  HUB_DOMAIN_CHARS characters (about the Wikipedia excerpt, the largest offline domain: the mixture is balanced only
  up to its smallest domain, so tokenising a whole C4 shard would be time spent on text no step reads), and its
  documents that mention NumPy are dropped (a web page may quote NumPy's docstrings, the held-out third domain). Each
  is asked for with one probe bounded by PROBE_TIMEOUT_S; a Hub domain that fails to load is left out with one console
  line naming it and why, and the mixture goes on with the rest; the loads together get HUB_LOAD_TIMEOUT_S (300 s),
  and one still running then is left out the same way, so a slow or stalled Hub delays a run by that much at most.
  When no Hub domain loads, or the Hub does not answer (an unreachable Hub costs one bounded request), or
  HF_HUB_OFFLINE is set, `auto` is `mix`, exactly. For evaluation: the held-out last 25% of each domain of the same
  mixture (offline: of the calibration text). Calibration never sees the text perplexity is measured on. What the
  calibration text costs on other text, measured offline: README, "Calibration and evaluation text"; the online
  mixture has not been measured on a real model (the machines it was built on have no Hub access).

`--ood-text` names a second evaluation text of another domain than calibration, scored whole and gated like the first:
* `numpy-docs` (what `auto` picks): technical documentation, the held-out third domain: the docstrings of NumPy's
  public API (Examples and See Also sections dropped; ~207k SmolLM2 tokens with NumPy 2.4). No calibration text
  contains it, so no step of any conversion (calibration, layer selection, distillation) saw it. NumPy comes with
  every install.
* `news`: 300 ABC news articles, the background corpus of Lee, Pincombe and
  Welsh (2005) that gensim ships as test data (`gensim/test/test_data/lee_background.cor`, ~78k SmolLM2 tokens).
  gensim is a dependency only for its data files (this one, the Wikipedia excerpt, the Usenet sample), which are
  read, never imported. Part of `mix`: as --ood-text, for a calibration text without it.
* `usenet` (the Usenet posts of `mix`), a FILE, `builtin`, `wiki`, `wikitext-2` (its test split), or `none`. A text
  that is (part of) the calibration text is refused, and so is `wikitext-2` when the online mixture calibrated on its
  train split. numpy-docs is in no calibration domain, online or offline.
"""

import importlib.util
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Literal, NamedTuple

import torch

from ..conversion.atomic import atomic_file
from ..errors import HfcompressError
from ..paths import default_cache_dir
from ..progress import console

AUTO, BUILTIN, WIKI, WIKITEXT, NEWS, NONE = "auto", "builtin", "wiki", "wikitext-2", "news", "none"
MIX, USENET, NUMPY_DOCS = "mix", "usenet", "numpy-docs"
DATASET_PREFIX = "hf:"  # hf:REPO[:CONFIG], any `datasets` text dataset on the Hub
BUILTIN_TEXT_NAME = "python-language-reference (pydoc_data.topics)"
NEWS_TEXT_NAME = "lee-news (Lee et al. 2005 background corpus, 300 ABC news articles; gensim test data)"
GENSIM_DISTRIBUTION, NEWS_FILE = "gensim", "gensim/test/test_data/lee_background.cor"
WIKI_TEXT_NAME = "enwiki-sample (106 Wikipedia articles, a 2013 dump excerpt; gensim test data)"
WIKI_FILE = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# headings after which a Wikipedia article is lists of references and links, not prose
WIKI_END_SECTIONS = ("References", "External links", "See also", "Further reading", "Notes", "Bibliography", "Sources")
USENET_TEXT_NAME = "usenet-sample (200 Usenet posts of alt.atheism and sci.space, 1993, headers dropped; the 20 Newsgroups sample gensim ships as test data)"
USENET_FILE = "gensim/test/test_data/mini_newsgroup"
# the mixture's domains, in this order (those installed): their short names (text before " (") make the mixture's name
MIX_PREFIX = "mixture of "
MIX_BLOCK_TOKENS = 512  # the mixture interleaves its domains in blocks of this many tokens (the default eval context)
HELD_OUT_FRACTION = 0.25
WIKITEXT_REPO, WIKITEXT_CONFIG = "Salesforce/wikitext", "wikitext-2-raw-v1"
C4_REPO, C4_FILE, C4_SPLIT = "allenai/c4", "en/c4-validation.00000-of-00008.json.gz", "validation"
# GPTQ's C4 perplexity (and its followers') scores the first 1,100 documents of this shard: the mixture starts after them
C4_SKIPPED_DOCUMENTS = 1100
# a Hub domain is read up to this many characters, about the largest offline domain (the Wikipedia excerpt): the mixture
# is balanced only up to its smallest domain, so the rest of a C4 shard would be tokenised for nothing
HUB_DOMAIN_CHARS = 3_200_000
# the Hub domains' loads together (a first run downloads ~50 MB and prepares it); a load still running then is left
# out, so a slow or stalled Hub delays a run by this much at most
HUB_LOAD_TIMEOUT_S = 300.0
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
    data_files: str | None = None  # the one file of the repo read (C4's shard), where not a whole config

    def to_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if key != "data_files" or value is not None}


@dataclass(frozen=True)
class Text:
    """A named text. `held_out`: calibration reads its first 75% and evaluation its last 25% (no separate test split)."""

    name: str
    text: str
    held_out: bool
    dataset: HubDataset | None = None  # set for a Hub dataset split
    # a mixture (`mix`, or the online one of `auto`): its domains, each split 75% / 25% on its own (`mixture_split`)
    parts: tuple["Text", ...] = ()


# text name -> its Hub dataset, for every dataset split loaded in this process: the report records it next to the name
_HUB_DATASETS: dict[str, HubDataset] = {}


def hub_dataset(name: str) -> dict | None:
    """{id, config, split, revision} of the Hub dataset split a text of this report name was read from, else None
    (the built-in text, the news corpus and files are not Hub datasets)."""
    dataset = _HUB_DATASETS.get(name)
    return dataset.to_dict() if dataset else None


def hub_datasets(name: str) -> list[dict]:
    """Every Hub dataset split a text of this report name read: its own (`hub_dataset`), or those of a mixture's Hub
    domains (the card's `datasets:` lists them); [] for texts not from the Hub."""
    own = hub_dataset(name)
    if own is not None:
        return [own]
    return [_HUB_DATASETS[domain].to_dict() for domain in mixture_domain_names(name) if domain in _HUB_DATASETS]


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
    """What "auto" reads without the Hub: the mixture of every installed domain (`mix`)."""
    return mixture_text()


def text_cache_dir() -> Path:
    """Where parsed texts are cached: $HFCOMPRESS_TEXT_CACHE, else texts/ in the hfcompress cache directory. A parsed
    text depends on its source file only, so caches that are otherwise kept apart (the tests') can share it."""
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


def news_text() -> Text:
    """The Lee news corpus, whole (one article a line)."""
    return Text(NEWS_TEXT_NAME, news_file().read_text(encoding="utf-8"), held_out=True)


def usenet_file() -> Path | None:
    """The 20 Newsgroups sample, or None without gensim."""
    return gensim_data_file(USENET_FILE)


class _Opaque:
    """What the Usenet sample's pickle holds besides text (numpy label arrays): built, never used."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


class _TextOnlyUnpickler:
    """Reads gensim's pickled scikit-learn `Bunch` of newsgroup posts without importing scikit-learn or numpy: the
    Bunch is read as a dict, every other class as `_Opaque`; nothing is called but dict, object and copyreg's
    reconstructor, so the pickle runs no code."""

    SAFE = {("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"), ("__builtin__", "dict"),
            ("builtins", "dict"), ("__builtin__", "object"), ("builtins", "object")}

    @classmethod
    def load(cls, data: bytes) -> dict:
        import io
        import pickle

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str):
                if (module, name) in cls.SAFE:
                    return super().find_class(module, name)
                return dict if name == "Bunch" else _Opaque

        return Unpickler(io.BytesIO(data), encoding="latin1").load()


def usenet_text() -> Text:
    """200 Usenet posts (alt.atheism, sci.space; 1993): each post's Subject line, then its body (the header block up to
    the first blank line dropped: paths, addresses, message ids). Conversational English, quotes and signatures
    included."""
    import zlib

    source = usenet_file()
    if source is None:
        raise HfcompressError(f"'{USENET}': the Usenet sample comes with the gensim wheel, which is not installed: run `pip install gensim`.")
    posts = []
    for post in _TextOnlyUnpickler.load(zlib.decompress(source.read_bytes()))["data"]:
        header, _, body = post.replace("\r\n", "\n").partition("\n\n")
        subject = next((line[len("Subject:"):].strip() for line in header.splitlines() if line.startswith("Subject:")), "")
        posts.append(f"{subject}\n\n{body.strip()}".strip())
    return Text(USENET_TEXT_NAME, "\n\n".join(posts), held_out=True)


def numpy_docs_name() -> str:
    import numpy

    return (
        f"numpy-docs (NumPy {numpy.__version__} API reference: the docstrings of its public functions and classes, "
        "Examples, See Also and doctests dropped; technical documentation)"
    )


def numpy_docs_text() -> Text:
    """Technical documentation: the docstrings of NumPy's public API (numpy, linalg, fft, random, ma, polynomial,
    char), each cut before its Examples / See Also section and without its other doctest paragraphs (code, not
    prose), in an order fixed by a hash of the
    qualified name (so the first tokens scored are a spread of the API, not its alphabetical start). NumPy comes with
    every install (transformers needs it); no calibration text contains this one."""
    import hashlib
    import inspect

    import numpy

    modules = [numpy, numpy.linalg, numpy.fft, numpy.random, numpy.ma, numpy.polynomial, numpy.char]
    docs: dict[str, str] = {}
    seen = set()
    for module in modules:
        for name in sorted(dir(module)):
            obj = getattr(module, name, None) if not name.startswith("_") else None
            if obj is None or inspect.ismodule(obj):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 200:
                continue
            doc = re.split(r"\n(?:Examples|See Also)\n-{4,}", doc)[0].strip()
            doc = "\n\n".join(p for p in doc.split("\n\n") if ">>>" not in p)  # doctests elsewhere: code, not prose
            if doc not in seen:
                seen.add(doc)
                docs[f"{module.__name__}.{name}"] = doc
    order = sorted(docs, key=lambda qualified: hashlib.sha1(qualified.encode()).hexdigest())
    return Text(numpy_docs_name(), "\n\n".join(f"{name}\n\n{docs[name]}" for name in order), held_out=False)


def mixture_domains() -> list[Text]:
    """The mixture's domains that are installed, in a fixed order: Wikipedia (encyclopedic), news, the Python
    language reference (a language's documentation) and Usenet posts (conversational). gensim (a dependency) carries
    three of them; without it the mixture is the Python language reference alone, and says so."""
    domains = []
    if wiki_available():
        domains.append(Text(WIKI_TEXT_NAME, wiki_text(), held_out=True))
    if news_file() is not None:
        domains.append(news_text())
    domains.append(Text(BUILTIN_TEXT_NAME, builtin_text(), held_out=True))
    if usenet_file() is not None:
        domains.append(usenet_text())
    return domains


def short_name(name: str) -> str:
    """A text's name up to its description in parentheses: `lee-news`, `enwiki-sample`, ..."""
    return name.split(" (")[0]


def mixture_text(hub_domains: tuple[Text, ...] = ()) -> Text:
    """`mix`: every installed domain (`mixture_domains`) in equal shares (`mixture_split`); the online mixture of
    "auto" adds the Hub domains that loaded (`hub_domains`) after them."""
    domains = mixture_domains() + list(hub_domains)
    if len(domains) == 1:
        console.log(
            "[yellow]calibration mixture: only the Python language reference is installed (gensim, which carries the "
            "Wikipedia, news and Usenet texts, is missing): one domain[/]"
        )
    name = f"{MIX_PREFIX}{', '.join(short_name(d.name) for d in domains)} (equal shares of {MIX_BLOCK_TOKENS}-token blocks)"
    return Text(name, "", held_out=True, parts=tuple(domains))


def mixture_domain_names(name: str) -> list[str]:
    """The short names of a mixture's domains, from its (report) name; [] for a text that is not a mixture."""
    if not name.startswith(MIX_PREFIX):
        return []
    return name.removeprefix(MIX_PREFIX).split(" (")[0].split(", ")


def interleave(streams: list[torch.Tensor], block: int, generator: torch.Generator | None) -> tuple[torch.Tensor, int]:
    """(the streams cut into `block`-token blocks and interleaved in rounds, the tokens before the first stream runs out).

    Every block is `block` tokens (a stream's last, shorter piece is left out), and round k holds block k of every
    stream that still has one, so every prefix of the result has the streams in equal shares (to one block) until the
    shortest is spent; after that the longer ones continue alone. With a generator,
    each stream's blocks are shuffled first and the order within each round is drawn (seeded); without one, blocks
    keep their order and rounds follow the streams' order (evaluation: the same tokens whatever the seed)."""
    blocks = []
    for ids in streams:
        pieces = list(ids[: len(ids) // block * block].split(block))
        if generator is not None:
            pieces = [pieces[i] for i in torch.randperm(len(pieces), generator=generator).tolist()]
        blocks.append(pieces)
    rounds = max(len(pieces) for pieces in blocks)
    out, balanced = [], None
    for k in range(rounds):
        if balanced is None and any(k >= len(pieces) for pieces in blocks):
            balanced = sum(len(piece) for piece in out)
        order = torch.randperm(len(blocks), generator=generator).tolist() if generator is not None else range(len(blocks))
        out.extend(blocks[d][k] for d in order if k < len(blocks[d]))
    ids = torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
    return ids, len(ids) if balanced is None else balanced


@dataclass
class MixtureSplit:
    """A mixture's token ids: every domain's first 75% interleaved (calibration, layer selection, distillation) and its
    held-out last 25% interleaved (evaluation). No block of one is in the other."""

    calibration: torch.Tensor
    held_out: torch.Tensor
    balanced_tokens: int  # calibration tokens before the smallest domain's share is spent
    domains: dict[str, tuple[int, int]]  # short name -> (its calibration tokens, its held-out tokens)
    owner: torch.Tensor  # per calibration id: the index of its domain in `domains`

    def shares(self, tokens: int) -> dict[str, int]:
        """How many of the first `tokens` calibration ids each domain gave."""
        counts = self.owner[:tokens].bincount(minlength=len(self.domains))
        return {name: int(count) for name, count in zip(self.domains, counts)}


def mixture_split(tokenizer, text: Text, seed: int = 0) -> MixtureSplit:
    """Split every domain of a mixture 75% / 25% on its own tokens, then interleave the calibration parts (blocks
    shuffled, rounds drawn with `seed`) and the held-out parts (in order, seed-independent)."""
    calibration, held_out, owners, domains = [], [], [], {}
    for index, domain in enumerate(text.parts):
        split = tokenize_split(tokenizer, domain.text, domain.name)
        calibration.append(split.calibration)
        held_out.append(split.held_out)
        owners.append(torch.full_like(split.calibration, index))
        domains[short_name(domain.name)] = (len(split.calibration), len(split.held_out))
    calib_ids, balanced = interleave(calibration, MIX_BLOCK_TOKENS, torch.Generator().manual_seed(seed))
    owner, _ = interleave(owners, MIX_BLOCK_TOKENS, torch.Generator().manual_seed(seed))  # the same draws: the same order
    held_ids, _ = interleave(held_out, MIX_BLOCK_TOKENS, None)
    return MixtureSplit(calib_ids, held_ids, balanced, domains, owner)


def read_text_file(path: Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise HfcompressError(f"Cannot read text file {path}: {err}.") from err
    if len(text.split()) < 200:
        raise HfcompressError(f"Text file {path} is too short: give at least a few thousand words.")
    return text


class Probe(NamedTuple):
    """What asking the Hub for a dataset's revision found."""

    revision: str | None  # the commit the Hub names for the dataset's main branch
    reason: str | None  # why the dataset cannot be loaded from the Hub now; None when it can
    answered: bool  # the Hub answered (an HTTP error for this dataset still lets another one load)


@lru_cache(maxsize=8)
def _probe_dataset(endpoint: str, repo: str = WIKITEXT_REPO) -> Probe:
    """The revision of dataset `repo`, or why it is unavailable: one request, bounded in time (PROBE_TIMEOUT_S).

    Cached per endpoint and repo, so calibration and evaluation in one run ask once."""
    from huggingface_hub import HfApi

    try:
        # revision-qualified, as datasets' own downloads ask: a mirror may refuse the bare /api/datasets/{repo}
        info = HfApi(endpoint=endpoint).dataset_info(repo, revision="main", timeout=PROBE_TIMEOUT_S)
    except Exception as err:  # DNS, refused, timeout, 401/404: every failure means the same here
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status:
            return Probe(None, f"{endpoint} answered HTTP {status} for {repo}", True)
        return Probe(None, f"the Hub at {endpoint} is unreachable ({type(err).__name__})", False)
    return Probe(info.sha, None, True)


def _dataset_revision(repo: str = WIKITEXT_REPO) -> Probe:
    """The revision of dataset `repo` to load, or why it cannot be loaded from the Hub now."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return Probe(None, "HF_HUB_OFFLINE is set", False)
    if importlib.util.find_spec("datasets") is None:
        return Probe(None, "the datasets package is not installed", False)
    return _probe_dataset(constants.ENDPOINT, repo)


def _load_rows(dataset: HubDataset):
    """The `datasets` split `dataset` names (a `datasets.Dataset` with a `text` column)."""
    import datasets

    where = dataset.data_files or dataset.config
    described = f"{dataset.id} ({where + ', ' if where else ''}{dataset.split} split)"
    files = {"data_files": {dataset.split: dataset.data_files}} if dataset.data_files else {}
    try:
        rows = datasets.load_dataset(dataset.id, dataset.config, split=dataset.split, revision=dataset.revision, **files)
    except Exception as err:  # datasets raises many kinds (connection, missing cache, bad files): one sentence for all
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HfcompressError(f"Cannot load {described}: {first_line}") from err
    if "text" not in rows.column_names:
        raise HfcompressError(f"{described} has no 'text' column (it has {', '.join(rows.column_names)}): choose a text dataset.")
    return rows


def _load_dataset(repo: str, config: str | None, split: str, revision: str | None) -> Text:
    """The `text` column of a `datasets` dataset split, rows joined with blank lines, named with its revision."""
    dataset = HubDataset(repo, config, split, revision)
    rows = _load_rows(dataset)
    at = f" @{revision[:8]}" if revision else ""
    text = Text(f"{repo}{' ' + config if config else ''}, {split} split{at}", "\n\n".join(rows["text"]), False, dataset)
    _HUB_DATASETS[text.name] = dataset
    return text


def _load_wikitext(split: str, revision: str | None) -> Text:
    return _load_dataset(WIKITEXT_REPO, WIKITEXT_CONFIG, split, revision)


@dataclass(frozen=True)
class HubDomain:
    """A domain of the online mixture: a split of a Hub dataset."""

    short: str  # its name in the mixture's name, followed there by the revision loaded
    dataset: HubDataset  # revision None: the one the Hub names at load time
    skip: int  # documents (rows) left out at its start
    about: str  # what kind of text it is


HUB_DOMAINS = (
    HubDomain("wikitext-2", HubDataset(WIKITEXT_REPO, WIKITEXT_CONFIG, "train", None), 0, "Wikipedia's Good and Featured articles"),
    HubDomain("c4", HubDataset(C4_REPO, None, C4_SPLIT, None, C4_FILE), C4_SKIPPED_DOCUMENTS, "English web pages, GPTQ's calibration corpus"),
)


def _hub_domain_text(domain: HubDomain, revision: str | None) -> Text:
    """A Hub domain at `revision`: its documents after the first `domain.skip`, those mentioning NumPy dropped (a web
    page may quote NumPy's docstrings, the held-out third domain), joined with blank lines up to HUB_DOMAIN_CHARS."""
    dataset = replace(domain.dataset, revision=revision)
    rows = _load_rows(dataset)
    kept, size = [], 0
    for start in range(domain.skip, len(rows), 1000):  # read in slices: a C4 shard holds ~45k documents
        for row in rows[start : start + 1000]["text"]:
            if size < HUB_DOMAIN_CHARS and "numpy" not in row.lower():
                kept.append(row)
                size += len(row) + 2
        if size >= HUB_DOMAIN_CHARS:
            break
    where = f"{dataset.id} {dataset.data_files or dataset.config}, {dataset.split} split"
    skipped = f", from document {domain.skip + 1:,}" if domain.skip else ""
    at = f" @{revision[:8]}" if revision else ""
    name = (f"{domain.short}{at} ({where}{skipped}, up to {HUB_DOMAIN_CHARS:,} characters, documents "
            f"mentioning NumPy dropped; {domain.about})")
    text = "\n\n".join(kept)
    if len(text.split()) < 200:
        after = f" after its first {domain.skip:,} documents" if domain.skip else ""
        raise HfcompressError(f"Cannot use {where}: it has only {len(text.split())} words{after}, too few to calibrate on.")
    return Text(name, text, held_out=True, dataset=dataset)


@lru_cache(maxsize=2)
def _hub_domains(endpoint: str) -> tuple[Text, ...]:
    """The online mixture's Hub domains that load from `endpoint`, each pinned to the revision its probe names (one
    request each, bounded in time); one console line for each that does not, and the mixture goes on without it.
    Cached per endpoint, so calibration and evaluation load them once."""
    loaded, deadline = [], time.monotonic() + HUB_LOAD_TIMEOUT_S
    for domain in HUB_DOMAINS:
        revision, reason, _ = _probe_dataset(endpoint, domain.dataset.id)
        if reason is None:
            try:
                text = _load_before(domain, revision, deadline)
            except HfcompressError as err:
                reason = str(err)
            else:
                _HUB_DATASETS[short_name(text.name)] = text.dataset  # what the report's calibration `datasets` lists
                loaded.append(text)
                continue
        console.log(f"calibration mixture: {domain.short} left out ({reason})", highlight=False)
    return tuple(loaded)


def _load_before(domain: HubDomain, revision: str | None, deadline: float) -> Text:
    """`_hub_domain_text`, waited for until `deadline` (time.monotonic()). The load runs in a daemon thread, so one
    still running then is abandoned, not waited for: its download resumes on the next run."""
    if time.monotonic() >= deadline:
        raise HfcompressError(f"the Hub domains before it took the {HUB_LOAD_TIMEOUT_S:g} s they are given")
    result: dict = {}

    def load() -> None:
        try:
            result["text"] = _hub_domain_text(domain, revision)
        except BaseException as err:  # handed to the waiting thread, which raises it
            result["error"] = err

    worker = threading.Thread(target=load, name=f"hfcompress-load-{domain.short}", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        raise HfcompressError(f"not loaded within {HUB_LOAD_TIMEOUT_S:g} s; its download resumes on the next run")
    if "error" in result:
        raise result["error"]
    return result["text"]


# set while a local source (a directory, a .gguf, the built-in model) is converted: its run asks the Hub for nothing
# it did not name, so "auto" is the offline mixture without a probe (wikitext-2 and hf:... still go to the Hub)
_LOCAL_SOURCE = ContextVar("hfcompress_local_source", default=False)
LOCAL_SOURCE_REASON = "the source is local, so auto asks the Hub for nothing (name wikitext-2 or hf:OWNER/NAME for Hub text)"


@contextmanager
def local_source_texts() -> Iterator[None]:
    """Within the block "auto" texts never touch the network: the conversion of a local source stays offline."""
    token = _LOCAL_SOURCE.set(True)
    try:
        yield
    finally:
        _LOCAL_SOURCE.reset(token)


def online_mixture() -> tuple[Text | None, str | None]:
    """(the online mixture, None): the offline domains and every Hub domain that loads, when the Hub answers; else
    (None, why not). An unreachable Hub costs one bounded request (the wikitext-2 probe) and no load; a local source's
    run (local_source_texts) makes none."""
    from huggingface_hub import constants

    if _LOCAL_SOURCE.get():
        return None, LOCAL_SOURCE_REASON
    probe = _dataset_revision()
    if not probe.answered:
        return None, probe.reason
    hub = _hub_domains(constants.ENDPOINT)
    if not hub:
        return None, "no Hub domain of the mixture loaded"
    return mixture_text(hub), None


def _load_named_dataset(spec: str, role: Role) -> Text:
    """`hf:REPO[:CONFIG]`: calibration reads its train split, evaluation its test split."""
    from huggingface_hub import constants

    repo, _, config = spec.removeprefix(DATASET_PREFIX).partition(":")
    option, split = _ROLES[role]
    revision, reason, _ = (None, None, False) if constants.HF_HUB_OFFLINE else _dataset_revision(repo)
    if reason is not None:
        raise HfcompressError(f"{option} {spec}: {reason}; check the network, or set HF_HUB_OFFLINE=1 to use a cached copy.")
    return _load_dataset(repo, config or None, split, revision)


def load_text(spec: str, role: Role, fallback: Text | None = None) -> Text:
    """The text `spec` names for `role`: a FILE path, a text name, `hf:...` or "auto".

    "auto" is the online mixture when the Hub answers and a Hub domain loads (`fallback` itself when it is that same
    mixture: calibration and evaluation then share one text), else `fallback` (default: `offline_text()`), with one
    console line saying which and why."""
    option, split = _ROLES[role]
    if spec == AUTO:
        online, reason = online_mixture()
        if online is not None:
            text = fallback if fallback is not None and fallback.name == online.name else online
            console.log(f"{role} text: {part_name(text, role)} (auto: the Hub is reachable)", highlight=False)
            return text
        text = fallback or offline_text()
        console.log(f"{role} text: {part_name(text, role)} (auto: {reason})", highlight=False)
        return text
    if spec == BUILTIN:
        return Text(BUILTIN_TEXT_NAME, builtin_text(), held_out=True)
    if spec == WIKI:
        return Text(WIKI_TEXT_NAME, wiki_text(), held_out=True)
    if spec == MIX:
        return mixture_text()
    if spec == WIKITEXT:
        from huggingface_hub import constants

        revision, reason, _ = (None, None, False) if constants.HF_HUB_OFFLINE else _dataset_revision()  # offline: the cached copy
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
    names = (NUMPY_DOCS, NEWS, USENET, BUILTIN, WIKI, WIKITEXT, NONE, AUTO) if role == "other-domain" else (MIX, BUILTIN, WIKI, WIKITEXT, AUTO)
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
    if spec in (NEWS, USENET) and (news_file() if spec == NEWS else usenet_file()) is None:
        raise HfcompressError(
            f"--ood-text {spec}: the {spec} text comes with the gensim wheel, which is not installed: run "
            f"`pip install gensim`, or pass '{NUMPY_DOCS}', a text file or 'none'."
        )


def other_domain_ids(tokenizer, spec: str, calibration_name: str) -> tuple[torch.Tensor, str] | None:
    """(ids, name) of the other-domain evaluation text, scored whole; None for 'none'. 'auto' is the held-out third
    domain, NumPy's API documentation: in no calibration text, so no step of a conversion (calibration, layer
    selection, distillation) saw it."""
    if spec == NONE:
        return None
    if spec == WIKITEXT and WIKITEXT in [domain.partition(" @")[0] for domain in mixture_domain_names(calibration_name)]:
        raise HfcompressError(
            f"--ood-text {WIKITEXT}: the calibration mixture has wikitext-2 (its train split) as a domain: choose a text "
            f"of another domain, e.g. '{NUMPY_DOCS}' or a file."
        )
    if spec in (AUTO, NUMPY_DOCS):
        text = numpy_docs_text()
    elif spec == NEWS:
        text = Text(NEWS_TEXT_NAME, news_file().read_text(encoding="utf-8"), held_out=False)
    elif spec == USENET:
        text = usenet_text()
    elif spec == BUILTIN:
        text = Text(BUILTIN_TEXT_NAME, builtin_text(), held_out=False)
    elif spec == WIKI:
        text = Text(WIKI_TEXT_NAME, wiki_text(), held_out=False)
    elif spec == WIKITEXT or spec.startswith(DATASET_PREFIX):
        text = load_text(spec, "other-domain")
    else:
        text = Text(str(spec), read_text_file(Path(spec)), held_out=False)
    if calibration_name.startswith(text.name) or short_name(text.name) in mixture_domain_names(calibration_name):
        raise HfcompressError(
            f"--ood-text is {'part of ' if calibration_name.startswith(MIX_PREFIX) else ''}the calibration text "
            f"({short_name(text.name)}): choose a text of another domain, e.g. '{NUMPY_DOCS}' or a file."
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
    if text.parts:
        return f"{text.name}, first 75% of each" if role == "calibration" else f"{text.name}, held-out last 25% of each"
    return f"{text.name}, first 75%" if role == "calibration" else f"{text.name}, held-out last 25%"


def evaluation_ids(tokenizer, text: Text) -> tuple[torch.Tensor, str]:
    """(token ids scored for perplexity, their name for the report)."""
    if text.parts:  # a mixture: every domain's held-out part, interleaved in order (the same whatever the seed)
        return mixture_split(tokenizer, text).held_out, part_name(text, "evaluation")
    ids = tokenize_split(tokenizer, text.text, text.name).held_out if text.held_out else tokenize(tokenizer, text.text)
    return ids, part_name(text, "evaluation")


def text_streams(
    tokenizer, calib_spec: str, eval_spec: str, calib_tokens: int, seed: int = 0
) -> tuple[torch.Tensor, str, torch.Tensor, str]:
    """(calibration ids (at least `calib_tokens` when the text has them), their name, evaluation ids, their name).

    An "auto" evaluation text is the held-out part of the online mixture, or without it of the calibration text. A mixture's
    calibration ids are its interleaved domains (`seed` draws the order) up to where the smallest domain's share is
    spent, or `calib_tokens` when that is more: distillation draws its windows from all of them, so its domains stay
    in equal shares too."""
    calibration = load_text(calib_spec, "calibration")
    evaluation = load_text(eval_spec, "evaluation", fallback=calibration if calibration.held_out else None)
    if calibration.parts:
        mixture = mixture_split(tokenizer, calibration, seed)
        calib_ids = mixture.calibration[: max(calib_tokens, mixture.balanced_tokens)]
        shares = mixture.shares(calib_tokens)
        console.log(
            f"calibration mixture: first {min(calib_tokens, len(calib_ids)):,} tokens: "
            + ", ".join(f"{name} {count:,}" for name, count in shares.items()),
            highlight=False,
        )
        if evaluation == calibration:
            return calib_ids, part_name(calibration, "calibration"), mixture.held_out, part_name(evaluation, "evaluation")
        eval_ids, eval_name = evaluation_ids(tokenizer, evaluation)
        return calib_ids, part_name(calibration, "calibration"), eval_ids, eval_name
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
