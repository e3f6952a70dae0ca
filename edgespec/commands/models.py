"""`edgespec models list|pull|path|import|forget-learning`: the catalog from the command line."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from edgespec.catalog import default_pair, import_model, load_catalog, local_path, store_dir
from edgespec.fetch import pull, resolve_model
from edgespec.units import format_size


def add_models_parser(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list, download, locate and import GGUF models")
    commands = parser.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    listing = commands.add_parser("list", help="catalog models and pairs, marking what is present locally")
    listing.set_defaults(func=_list)

    pulling = commands.add_parser("pull", help="download a catalog model (size and sha256 checked)")
    pulling.add_argument("name", help="catalog model name, e.g. qwen2.5-coder-1.5b-instruct")
    pulling.add_argument("--quiet", action="store_true", help="no progress bar")
    pulling.set_defaults(func=_pull)

    locating = commands.add_parser("path", help="print the local path of a present model")
    locating.add_argument("name", help="catalog model name")
    locating.set_defaults(func=_path)

    importing = commands.add_parser("import", help="register a local GGUF file under a name")
    importing.add_argument("file", help="path to a .gguf file")
    importing.add_argument("--name", help="catalog name to use (default: from the file name)")
    importing.set_defaults(func=_import)

    forgetting = commands.add_parser(
        "forget-learning", help="drop what a model's drafters learned on this machine (new runs start from neutral priors)")
    forgetting.add_argument("name", nargs="?", help="catalog model name or GGUF path (default: every model)")
    forgetting.set_defaults(func=_forget_learning)


def _list(args: argparse.Namespace) -> int:
    catalog = load_catalog()
    target, draft = default_pair()
    roles = {target: "default target", draft: "default draft"}
    table = Table(title=f"models (store: {store_dir()})")
    for column in ("name", "arch", "quant", "size", "status", "where"):
        table.add_column(column, no_wrap=column in ("name", "size", "status"))
    for entry in catalog.models.values():
        present = local_path(entry)
        size = present.stat().st_size if present else entry.size
        label = entry.name + (f" ({roles[entry.name]})" if entry.name in roles else "")
        table.add_row(
            label, entry.architecture, entry.quantization,
            format_size(size) if size else "?",
            "[green]present[/]" if present else "[yellow]missing[/]",
            str(present) if present else " | ".join(source.describe() for source in entry.sources),
        )
    pairs = Table(title="pairs")
    for column in ("pair", "target", "draft", ""):
        pairs.add_column(column)
    for pair in catalog.pairs:
        pairs.add_row(pair.name, pair.target, pair.draft, "default" if pair.default else "")
    console = Console()
    console.print(table)
    console.print(pairs)
    return 0


def _pull(args: argparse.Namespace) -> int:
    print(pull(args.name, progress=not args.quiet))
    return 0


def _path(args: argparse.Namespace) -> int:
    print(resolve_model(args.name, pull=False))
    return 0


def _import(args: argparse.Namespace) -> int:
    entry = import_model(args.file, name=args.name)
    print(f"imported {entry.name}: {entry.architecture} {entry.quantization}, "
          f"{format_size(entry.size)}, {entry.sources[0].path}")
    return 0


def _forget_learning(args: argparse.Namespace) -> int:
    from edgespec.learned import LearnedAcceptance, forget_all

    if args.name is None:
        where = forget_all()
        print(f"forgot what every model learned ({where})")
        return 0
    store = LearnedAcceptance(resolve_model(args.name, pull=False))
    forgot = store.forget()
    print(f"forgot what {args.name} learned ({store.path})" if forgot else f"nothing learned for {args.name} yet ({store.path})")
    return 0
