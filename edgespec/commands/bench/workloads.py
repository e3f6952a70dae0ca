"""The bench's prompts: one JSONL file per suite under benchmarks/workloads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ...errors import EdgespecError
from ...notices import print_notice
from ...text import json_kind, surrogate_problem

WORKLOADS_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "workloads"
SUITES = ("code-edit", "summarize", "qa-context", "chat", "creative")


class BenchError(EdgespecError):
    """The bench cannot run as asked: unknown suite or configuration, bad workload file."""

    exit_code = 2


@dataclass(frozen=True)
class BenchPrompt:
    suite: str
    id: str
    prompt: str
    max_tokens: int


def load_workloads(
    suites: Iterable[str] | None = None, per_suite: int | None = None, directory: Path = WORKLOADS_DIR
) -> list[BenchPrompt]:
    """The prompts of these suites (None: every suite the folder holds), the first per_suite of each."""
    directory = Path(directory)
    if suites is None:
        suites = suites_in(directory)
        if not suites:
            raise BenchError(f"no workloads to run: {_holds(directory)}")
        _say_what_is_left_out(directory, suites)
    suites = list(suites)
    if not suites:
        raise BenchError("--suites names no suite: give one or more, comma-separated, or leave it out for all")
    prompts = []
    for suite in suites:
        path = directory / f"{suite}.jsonl"
        if not path.is_file():
            raise BenchError(f"no workload file for suite {suite!r} at {path}; {_holds(directory)}")
        prompts.extend(_read_suite(suite, path)[:per_suite])
    if not prompts:
        raise BenchError(f"no prompts to run: {', '.join(f'{suite}.jsonl' for suite in suites)} in {directory} hold none")
    return prompts


def suites_in(directory: Path) -> list[str]:
    """The suites a workloads folder holds: its <suite>.jsonl files of prompts, the built-in suites first, in
    their order, then the others by name."""
    found = {path.stem for path in directory.glob("*.jsonl") if _starts_with_a_workload_line(path)}
    return [suite for suite in SUITES if suite in found] + sorted(found.difference(SUITES))


def _left_out(directory: Path, suites: list[str]) -> list[str]:
    """The .jsonl files that are neither suites nor recorded replies (replies-*.jsonl)."""
    return sorted(path.name for path in directory.glob("*.jsonl")
                  if path.stem not in suites and not path.name.startswith("replies-"))


def _say_what_is_left_out(directory: Path, suites: list[str]) -> None:
    """A notice naming the files _left_out: a suite whose first line is broken was left out of the bench without
    a word."""
    left_out = _left_out(directory, suites)
    if left_out:
        print_notice(f"bench: left out {', '.join(left_out)} in {directory}: the first line is not a workload "
                     "line ({\"id\": ..., \"prompt\": ...}); name the suite with --suites to see why")


def _holds(directory: Path) -> str:
    """What a workloads folder offers instead, for the error that names a suite it lacks."""
    if not directory.is_dir():
        return f"there is no folder {directory} (--workloads)"
    suites = suites_in(directory)
    if not suites and (left_out := _left_out(directory, suites)):  # files whose first line is broken, as it was
        return (f"{directory} holds no <suite>.jsonl files of prompts: the first line of {left_out[0]} is not a "
                f"workload line; name it with --suites {Path(left_out[0]).stem} to see why")
    if not suites:
        return f"{directory} holds no <suite>.jsonl files of prompts"
    return f"name its suites with --suites: {', '.join(suites)}"


def _starts_with_a_workload_line(path: Path) -> bool:
    """Whether a JSONL file's first line is a prompt, not another record kept beside them (recorded replies)."""
    try:
        with path.open(encoding="utf-8-sig") as lines:  # -sig: a byte-order mark, as Notepad saves UTF-8
            first = next((line for line in lines if line.strip()), "")
        row = json.loads(first)
    except (OSError, ValueError, RecursionError):  # RecursionError: brackets nested thousands deep
        return False
    return isinstance(row, dict) and "id" in row and "prompt" in row


def _read_suite(suite: str, path: Path) -> list[BenchPrompt]:
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except OSError as err:
        raise BenchError(f"{path} cannot be read ({err.strerror or err}); check the path and its permissions") from None
    except UnicodeDecodeError as err:
        raise BenchError(f"{path} cannot be read as UTF-8 text ({err}); save it as UTF-8") from None
    prompts, lines_of = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompts.append(_workload_line(suite, _parsed(line)))
        except (ValueError, KeyError, TypeError) as err:
            raise BenchError(f"{path}:{number} is not a workload line ({err}); expected "
                             "{\"id\": ..., \"prompt\": \"text\", \"max_tokens\": a whole number from 1 up}") from None
        # runs are told apart by their prompt's id: a second prompt under one id was run as the first
        first = lines_of.setdefault(prompts[-1].id, number)
        if first != number:
            raise BenchError(f"{path}:{number} has the id {prompts[-1].id[:60]!r} of line {first}; give each prompt "
                             "an id of its own")
    return prompts


def _parsed(line: str):
    try:
        return json.loads(line)
    except RecursionError:  # json recurses once per bracket: a line of 100k "[" exhausts the stack
        raise ValueError("its JSON nests too deeply") from None


def _workload_line(suite: str, row) -> BenchPrompt:
    if not isinstance(row, dict):
        raise TypeError(f"it is a JSON {json_kind(row)}, not an object")
    if missing := [key for key in ("id", "prompt") if key not in row]:
        raise ValueError(f"it has no {missing[0]!r}")
    prompt, max_tokens = row["prompt"], row.get("max_tokens", 128)
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt is a JSON {json_kind(prompt)}, not text")
    # JSON's escapes can spell half a UTF-16 pair, which the tokenizer refuses only after the model has loaded
    for what, text in (("the prompt", prompt), ("the id", row["id"])):
        if isinstance(text, str) and (problem := surrogate_problem(text)):
            raise ValueError(f"{what} {problem}; give the character whole or leave it out")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens is {max_tokens!r}")
    return BenchPrompt(suite, str(row["id"]), prompt, max_tokens)

