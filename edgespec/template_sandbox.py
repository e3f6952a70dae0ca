"""The process that renders chat templates; edgespec.chat_template starts it.

A chat template comes from a downloaded GGUF file, so it is untrusted code.
Jinja's immutable sandbox keeps it away from Python's internals, but not from
spending unbounded time or memory (nested ``range`` loops, ``'x' * 10**9``).
Rendering here, in a process of its own, lets the OS bound it: this process
caps its own address space and stops a render at its deadline, and the
parent kills it if even that does not answer in time.

Run as a script (``python -P template_sandbox.py``) so it imports jinja2
only, not edgespec and llama.cpp.  It reads one JSON request per line on
stdin and writes one JSON reply per line on stdout:

    request: {"source", "bos_token", "eos_token", "seconds", "max_chars",
              "renders": [{"messages", "add_generation_prompt"}, ...]}
    reply:   {"texts": [...]}  or  {"error": "one line"}
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from datetime import datetime

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MEMORY_LIMIT_BYTES = 1 << 30
_COMPILED_KEPT = 4  # templates kept compiled; one process serves every loaded model


class _Stopped(Exception):
    """A render ran past its deadline or its output size."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _deadline(seconds: float):
    def stop(signum, frame):
        raise _Stopped(f"it took longer than {seconds:g} s")
    return stop


def _render(template, render: dict, request: dict) -> str:
    pieces, size = [], 0
    for piece in template.generate(
        messages=render["messages"], add_generation_prompt=render["add_generation_prompt"],
        bos_token=request["bos_token"], eos_token=request["eos_token"],
    ):
        size += len(piece)
        if size > request["max_chars"]:
            raise _Stopped(f"its output passed {request['max_chars']:,} characters")
        pieces.append(piece)
    return "".join(pieces)


def _error_text(error: BaseException) -> str:
    if isinstance(error, _Stopped):
        return str(error)
    if isinstance(error, MemoryError):
        return f"it needed more than {MEMORY_LIMIT_BYTES >> 20} MiB of memory"
    if isinstance(error, TemplateSyntaxError):
        return f"syntax error on line {error.lineno}: {error.message}"
    return f"{type(error).__name__}: {error}"


def _answer(request: dict, env, compiled: dict) -> dict:
    signal.signal(signal.SIGALRM, _deadline(request["seconds"]))
    signal.setitimer(signal.ITIMER_REAL, request["seconds"])
    try:
        source = request["source"]
        template = compiled.get(source)
        if template is None:
            template = env.from_string(source)
            if len(compiled) >= _COMPILED_KEPT:
                compiled.clear()
            compiled[source] = template
        return {"texts": [_render(template, render, request) for render in request["renders"]]}
    except Exception as error:  # anything the template does is its failure, reported in one line
        return {"error": _error_text(error)}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's to handle
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT_BYTES, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):  # not enforced everywhere (macOS); the deadline still holds
        pass
    env, compiled = _environment(), {}
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:  # ends when the parent closes the pipe or exits
        try:
            reply = _answer(json.loads(line), env, compiled)
        except _Stopped as stopped:  # the deadline struck between the render and switching it off
            reply = {"error": str(stopped)}
        out.write(json.dumps(reply).encode("ascii") + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
