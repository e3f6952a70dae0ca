"""`edgespec models import`: a local GGUF registered under a name in the user's catalog (models.json), the one
place that file is written; catalog.py reads it with the shipped catalog."""

from __future__ import annotations

import json
import os
from pathlib import Path

from edgespec.catalog import (USER_CATALOG_NAME, Catalog, ModelEntry, load_catalog, local_path, name_problem,
                              parse_model, read_user_catalog, store_dir)
from edgespec.errors import EdgespecError
from edgespec.files import atomic_write
from edgespec.gguf_info import GGUFInfo, read_gguf_info
from edgespec.limits import MAX_VOCAB_SIZE_DIFFERENCE


def import_model(file: str | os.PathLike, name: str | None = None, draft_for: str | None = None,
                 replace: bool = False) -> ModelEntry:
    """Register a local GGUF under a name, so it lists and resolves like catalog models.

    draft_for: the name of a catalog model this one drafts for.  `--draft auto` then picks it for that
    target, before any draft the shipped catalog pairs with it; a later import for the same target replaces
    it.  A draft whose GGUF header already shows another tokenizer than the target's is refused here; the
    token-by-token check is the engine's, when it loads the pair.

    A name already imported for another file is refused unless replace is set, and even then when a pair
    the name is in would no longer share a vocabulary.
    """
    try:
        path = Path(file).expanduser().resolve()
    except (RuntimeError, OSError) as error:  # Python 3.11 says a symlink loop with a RuntimeError
        raise EdgespecError(f"cannot follow {file}: {error}; point at the .gguf file itself") from None
    info = read_gguf_info(path)
    name = _name_from_file(path) if name is None else name
    problem = name_problem(name)
    if problem is not None:
        raise EdgespecError(f"the catalog name {name!r} {problem}")
    catalog = load_catalog()
    existing = catalog.models.get(name)
    if existing is not None and not existing.imported:
        raise EdgespecError(f"{name} is already a catalog model; import under another name with --name")
    if existing is not None and Path(existing.sources[0].path).expanduser().resolve() != path:
        if not replace:
            raise EdgespecError(f"{name} already names {existing.sources[0].path}; import under another name "
                                f"with --name, or add --replace to point {name} at {path.name}")
        _check_pairs_still_hold(info, name, catalog)
    if draft_for is not None:
        _check_drafts_for(info, name, catalog, draft_for)
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
    user = read_user_catalog()
    models = [model for model in user.get("models", []) if model.get("name") != name] + [record]
    pairs = user.get("pairs", [])
    if draft_for is not None:
        pairs = [pair for pair in pairs if pair.get("target") != draft_for]
        pairs.append({"name": f"{draft_for} with {name}", "target": draft_for, "draft": [name]})
    store = store_dir()
    store.mkdir(parents=True, exist_ok=True)
    # keys this version does not know (a newer edgespec's) are kept: the file is the user's, not this version's
    atomic_write(store / USER_CATALOG_NAME, json.dumps({**user, "models": models, "pairs": pairs}, indent=2))
    return parse_model(record, store / USER_CATALOG_NAME)


def _check_drafts_for(draft: GGUFInfo, name: str, catalog: Catalog, target_name: str) -> None:
    """EdgespecError unless the draft may be paired with the catalog model target_name: another model, and
    (when its file is here) one whose header names the same tokenizer."""
    if target_name == name:
        raise EdgespecError(f"{name} cannot draft for itself; name another target with --draft-for")
    target_file = local_path(catalog.get(target_name))
    if target_file is None:
        return  # not pulled yet: the engine checks the pair when it loads it
    differences = _vocabulary_differences(read_gguf_info(target_file), draft)
    if differences:
        raise EdgespecError(f"{draft.path.name} cannot draft for {target_name}: its vocabulary is not the target's "
                            f"({'; '.join(differences)}); pair it with a model of its own family")


def _check_pairs_still_hold(info: GGUFInfo, name: str, catalog: Catalog) -> None:
    """EdgespecError when name, pointed at the file info describes, would leave a pair of it (as target or
    draft, with the other's file here) without a shared vocabulary."""
    for pair in catalog.pairs:
        for draft_name in pair.drafts:
            if name not in (pair.target, draft_name):
                continue
            other_entry = catalog.models.get(draft_name if name == pair.target else pair.target)
            other_file = local_path(other_entry) if other_entry is not None else None
            if other_file is None:
                continue  # not here: the engine checks the pair when it loads it
            other = read_gguf_info(other_file)
            differences = _vocabulary_differences(*((info, other) if name == pair.target else (other, info)))
            if differences:
                raise EdgespecError(f"{name} cannot be pointed at {info.path.name}: {draft_name} drafts for "
                                    f"{pair.target}, and their vocabularies would differ ({'; '.join(differences)})")


def _vocabulary_differences(target: GGUFInfo, draft: GGUFInfo) -> list[str]:
    differences = [
        f"{what} {theirs!r} vs {ours!r}" for what, theirs, ours in (
            ("tokenizer", target.tokenizer_model, draft.tokenizer_model),
            ("pre-tokenizer", target.metadata.get("tokenizer.ggml.pre"), draft.metadata.get("tokenizer.ggml.pre")),
            ("BOS/EOS ids", (target.bos_id, target.eos_id), (draft.bos_id, draft.eos_id)),
        ) if theirs != ours
    ]
    if abs(target.vocab_size - draft.vocab_size) > MAX_VOCAB_SIZE_DIFFERENCE:
        differences.append(f"vocabulary sizes {target.vocab_size} vs {draft.vocab_size}")
    return differences


def _name_from_file(path: Path) -> str:
    # a file's name may hold what a catalog name may not: spaces and control characters become dashes
    words = "".join(char if char.isprintable() else " " for char in path.stem.lower().replace("_", "-")).split()
    return "-".join(words)
