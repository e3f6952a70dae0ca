"""The rich Console that prints a command's results on stdout (plan's and models' tables, bench's report)."""

from __future__ import annotations

from rich.console import Console


class ResultsConsole(Console):
    """rich's Console, but a reader that goes away (`edgespec bench | head`) ends the command as it ends every
    other: rich's own answer was exit 1 without a word, which bench documents as a failed exactness check."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more to write: the main loop points stdout at /dev/null and exits 141
        raise BrokenPipeError
