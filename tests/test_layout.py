"""The package layout: imports point one way, modules and functions stay small.

Reads the source (ast) of every module under edgespec/ and tui/, function-local
imports included (an import inside a function still ties the two modules
together; it only hides a cycle until the function runs).  Layers, from the
bottom (see README "How it works"): the core, then loading (files -> a plan ->
an Engine), then the commands and the chat app.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edgespec", "tui")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# The core: the decoding loop and what it stands on.  None of it may reach up.
CORE = {f"edgespec.{name}" for name in (
    "errors", "limits", "units", "files", "sysinfo", "backend", "sampling", "verify", "drafters", "controller", "costs",
    "calibration", "pass_prices", "exactness", "curve_timing", "cost_profile", "draft_cost", "chat_template", "stats", "engine", "session", "template_sandbox", "notices", "text",
    "phases", "scheduler", "prefix_cache", "generation", "drafting", "decoder", "sequence_cache", "heads",
)}
ABOVE_THE_CORE = ("edgespec.loading", "edgespec.draft_payoff", "edgespec.catalog", "edgespec.fetch", "edgespec.planner",
                  "edgespec.commands", "tui")

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported_names(name: str, path: Path) -> set[str]:
    """Every module `name` imports, resolved to absolute names (an `import a.b` counts as a.b)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from . import models` imports a module, not a name
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return found


def internal_imports(name: str) -> set[str]:
    """The modules of edgespec/ and tui/ that `name` imports (a package's own __init__ left out)."""
    result = set()
    for imported in imported_names(name, MODULES[name]):
        while imported and imported not in MODULES:
            imported = imported.rpartition(".")[0]
        if imported and imported != name and not name.startswith(imported + "."):
            result.add(imported)
    return result


GRAPH = {name: internal_imports(name) for name in MODULES}


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_there_is_no_import_cycle():
    visiting, done, cycles = [], set(), []

    def visit(name):
        if name in done:
            return
        if name in visiting:
            cycles.append(visiting[visiting.index(name):] + [name])
            return
        visiting.append(name)
        for imported in sorted(GRAPH[name]):
            visit(imported)
        visiting.pop()
        done.add(name)

    for name in sorted(GRAPH):
        visit(name)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_the_core_imports_nothing_above_it():
    wrong = sorted((name, imported) for name in GRAPH if name in CORE for imported in GRAPH[name]
                   if any(is_under(imported, high) for high in ABOVE_THE_CORE))
    assert not wrong, wrong


def test_nothing_in_edgespec_imports_the_commands_or_the_chat_app():
    wrong = sorted((name, imported) for name in GRAPH if is_under(name, "edgespec")
                   and not is_under(name, "edgespec.commands") and name != "edgespec.__main__"  # the entry point
                   for imported in GRAPH[name]
                   if is_under(imported, "edgespec.commands") or is_under(imported, "tui"))
    assert not wrong, wrong


def test_the_chat_app_does_not_import_the_commands():
    wrong = sorted((name, imported) for name in GRAPH if is_under(name, "tui") for imported in GRAPH[name]
                   if is_under(imported, "edgespec.commands"))
    assert not wrong, wrong


def test_only_the_backend_touches_llama_cpp():
    wrong = sorted(name for name, path in MODULES.items() if not is_under(name, "edgespec.backend")
                   and any(is_under(imported, "llama_cpp") for imported in imported_names(name, path)))
    assert not wrong, wrong


def test_modules_and_functions_stay_short():
    long_modules, long_functions = [], []
    for name, path in MODULES.items():
        where = str(path.relative_to(ROOT))
        source = path.read_text(encoding="utf-8")
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{where}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


@pytest.mark.parametrize("name, source, expected", [
    ("edgespec.commands.models", "from .. import catalog\n", {"edgespec", "edgespec.catalog"}),
    ("edgespec.commands.batch.runner", "from ...errors import EdgespecError\n", {"edgespec.errors"}),
    ("edgespec.commands.chat", "def f():\n    from tui.app import run_chat\n", {"tui.app"}),
])
def test_the_import_reader_sees_relative_and_function_local_imports(tmp_path, name, source, expected):
    path = tmp_path / "x.py"
    path.write_text(source)
    assert imported_names(name, path) == expected
