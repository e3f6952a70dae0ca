"""`edgespec models list|pull|path|import|forget-learning`: the catalog from the command line."""

from __future__ import annotations

import argparse

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from edgespec.catalog import default_pair, load_catalog, local_path, name_problem, store_dir
from edgespec.commands.console import ResultsConsole
from edgespec.commands.options import file_path, model_text
from edgespec.control_chars import terminal_text
from edgespec.fetch import pull, resolve_model
from edgespec.model_import import import_model
from edgespec.units import format_size


def add_models_parser(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list, download, locate and import GGUF models")
    commands = parser.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    listing = commands.add_parser("list", help="catalog models and pairs, marking what is present locally")
    listing.set_defaults(func=_list)

    pulling = commands.add_parser("pull", help="download a catalog model (size and sha256 checked)")
    pulling.add_argument("name", type=model_text, help="catalog model name, e.g. qwen2.5-coder-1.5b-instruct")
    pulling.add_argument("--quiet", action="store_true", help="no progress bar")
    pulling.set_defaults(func=_pull)

    locating = commands.add_parser("path", help="print the local path of a present model")
    locating.add_argument("name", type=model_text, help="catalog model name")
    locating.set_defaults(func=_path)

    importing = commands.add_parser("import", help="register a local GGUF file under a name")
    importing.add_argument("file", type=file_path, help="path to a .gguf file")
    importing.add_argument("--name", type=_catalog_name, help="catalog name to use (default: from the file name)")
    importing.add_argument("--draft-for", metavar="TARGET",
                           help="a catalog model this one drafts for: --draft auto then uses it with TARGET")
    importing.add_argument("--replace", action="store_true",
                           help="point a name imported before at this file (its pairs must still share a vocabulary)")
    importing.set_defaults(func=_import)

    forgetting = commands.add_parser(
        "forget-learning", help="drop what a model's drafters learned on this machine (new runs start from neutral priors)")
    forgetting.add_argument("name", nargs="?", type=model_text,
                            help="catalog model name or GGUF path (default: every model)")
    forgetting.set_defaults(func=_forget_learning)


# The columns of each table, most important first: a terminal too narrow for all of them drops them
# from the end, so every column shown holds its values whole (a name or a path cut short is useless).
MODEL_COLUMNS = ("name", "status", "size", "quant", "arch", "where")
PAIR_COLUMNS = ("target", "draft", "default", "pair")
# Only a model's name may wrap (before its role), so rich narrows no other column to fit, and the
# name no further than its longest word.
WRAPPING = {"name"}
TSV_MODEL_COLUMNS = ("name", "role", "status", "size_bytes", "quant", "arch", "where")


def _list(args: argparse.Namespace) -> int:
    rows, pairs = _model_rows(), load_catalog().pairs
    console = ResultsConsole()
    if not console.is_terminal:
        _print_tsv(rows, pairs)
        return 0
    models = fitting_table(console, "models", MODEL_COLUMNS, [_model_cells(row) for row in rows], least=2)
    console.print(models)
    left_out = [column for column in MODEL_COLUMNS if column not in {c.header for c in models.columns}]
    if left_out:
        # a notice about the table, not a result: stderr, where the terminal shows it under the table all the same
        Console(stderr=True).print(f"[dim](too narrow for: {', '.join(left_out)}; `| cat` prints all)[/]")
    console.print(f"store: {store_dir()}", soft_wrap=True, highlight=False)
    pair_cells = [{"pair": Text(_one_cell(p.name)), "target": Text(p.target), "draft": Text(p.draft),
                   "default": Text("default" if p.default else "")} for p in pairs]
    if _least_width(PAIR_COLUMNS[:2], pair_cells) <= console.width:
        console.print(fitting_table(console, "pairs", PAIR_COLUMNS, pair_cells, least=2))
    else:  # too narrow for even the target and draft side by side: one under the other
        console.print("pairs:")
        for pair in pairs:
            console.print(Text(f"  {pair.target}{' (default)' if pair.default else ''}\n    draft: {pair.draft}"))
    return 0


def _print_tsv(rows: list[dict], pairs) -> None:
    """A pipe or a file gets tab-separated columns, the same at any width: a header, then one model a line;
    a blank line, then the pairs the same way."""
    print("\t".join(TSV_MODEL_COLUMNS))
    for row in rows:
        print("\t".join(str(row[column]) for column in TSV_MODEL_COLUMNS))
    print()
    print("\t".join(("pair", "target", "draft", "default")))
    for pair in pairs:
        print("\t".join((_one_cell(pair.name), pair.target, pair.draft, "default" if pair.default else "")))


def _model_rows() -> list[dict]:
    """Each catalog model's columns: present ones as they are here."""
    target, draft = default_pair()
    roles = {target: "default target", draft: "default draft"}
    rows = []
    for entry in load_catalog().models.values():
        present = local_path(entry)
        size = present.stat().st_size if present else entry.size
        rows.append({
            "name": entry.name, "role": roles.get(entry.name, ""), "status": "present" if present else "missing",
            "size_bytes": size if size else "", "quant": _one_cell(entry.quantization),
            "arch": _one_cell(entry.architecture),
            "where": _one_cell(str(present)) if present else " | ".join(_one_cell(source.describe())
                                                                         for source in entry.sources),
        })
    return rows


def _one_cell(text: str) -> str:
    """Text from models.json or the file system, drawn and not obeyed by a terminal (terminal_text), on one line
    of one column: a tab or a newline in a path split the TSV's rows."""
    return terminal_text(text).replace("\t", "\u2409").replace("\n", "\u2424")


def _model_cells(row: dict) -> dict[str, Text]:
    """A model's cells for the terminal's table: plain text (a name is never markup), one source a line."""
    return {
        "name": Text(row["name"] + (f" ({row['role']})" if row["role"] else "")),
        "status": Text(row["status"], style="green" if row["status"] == "present" else "yellow"),
        "size": Text(format_size(row["size_bytes"]) if row["size_bytes"] else "?"),
        "quant": Text(row["quant"]), "arch": Text(row["arch"]), "where": Text(row["where"].replace(" | ", "\n")),
    }


def fitting_table(console: Console, title: str, columns: tuple[str, ...], rows: list[dict[str, Text]],
                  least: int) -> Table:
    """The table of the most columns (in order of importance) whose cells all fit whole in the console;
    at least the first `least`, even when they do not fit."""
    count = len(columns)
    while count > least and _least_width(columns[:count], rows) > console.width:
        count -= 1
    table = Table(title=title)
    for column in columns[:count]:
        table.add_column(column, no_wrap=column not in WRAPPING)
    for cells in rows:
        table.add_row(*(cells[column] for column in columns[:count]))
    return table


def _least_width(columns: tuple[str, ...], rows: list[dict[str, Text]]) -> int:
    """The narrowest a table of these columns can be with every cell whole: each column as wide as its
    widest line (its widest word if it wraps), plus a space either side and the box's lines."""
    widths = []
    for column in columns:
        texts = [column, *(cells[column].plain for cells in rows)]
        pieces = [piece for text in texts for piece in (text.split() if column in WRAPPING else text.splitlines())]
        widths.append(max(map(cell_len, pieces), default=0))
    return sum(width + 2 for width in widths) + len(columns) + 1


def _catalog_name(text: str) -> str:
    """An argparse type for the name a model is imported under (catalog.name_problem)."""
    problem = name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return text


def _pull(args: argparse.Namespace) -> int:
    print(terminal_text(str(pull(args.name, progress=not args.quiet))))
    return 0


def _path(args: argparse.Namespace) -> int:
    print(terminal_text(str(resolve_model(args.name, pull=False))))
    return 0


def _import(args: argparse.Namespace) -> int:
    entry = import_model(args.file, name=args.name, draft_for=args.draft_for, replace=args.replace)
    print(f"imported {entry.name}: {entry.architecture} {entry.quantization}, "
          f"{format_size(entry.size)}, {terminal_text(entry.sources[0].path)}")
    if args.draft_for:
        print(f"--draft auto drafts with {entry.name} for {args.draft_for}")
    return 0


def _forget_learning(args: argparse.Namespace) -> int:
    from edgespec.learned import LearnedAcceptance, forget_all
    from edgespec.notices import print_notice

    if args.name is None:
        where = forget_all()
        print(f"forgot what every model learned ({where})")
        return 0
    store = LearnedAcceptance(resolve_model(args.name, pull=False), notice=print_notice)
    forgot = store.forget()
    print(f"forgot what {args.name} learned ({store.path})" if forgot else f"nothing learned for {args.name} yet ({store.path})")
    return 0
