"""The rich consoles of the command line: reports on stdout (``verify``, ``show``, the end of a tuning run) and
progress bars on stderr.

On a terminal rich fits the output to the terminal's width. Anywhere else (a pipe, a log file, CI, a test runner)
there is no width to fit: a console of ``NO_TTY_WIDTH`` columns keeps every table row and message on one line, so
that a path, a number or a command is never folded across lines (rich's default there is 80 columns).

Progress bars are drawn only where someone watches them: on stderr, when stderr is a terminal. In a log file or a
pipe (and under ``--json``) a long command prints its plain progress lines and no control characters."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from rich.console import Console

#: Columns of a console that does not write to a terminal: wider than any table row the reports print.
NO_TTY_WIDTH = 10_000


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def output_console() -> Console:
    """A console for stdout: the terminal's width on a terminal, else ``NO_TTY_WIDTH`` columns (no wrapping)."""
    return Console() if _isatty(sys.stdout) else Console(width=NO_TTY_WIDTH)


def progress_console() -> Console | None:
    """The console of the progress bars: stderr when it is a terminal, else None (no bar)."""
    return Console(stderr=True) if _isatty(sys.stderr) else None


class ProgressBar:
    """What a long run reports its progress to: ``start(total)`` once the amount of work is known, ``advance(what)``
    after each piece of it. This base class draws nothing (off a terminal, under ``--json``, in library use)."""

    def start(self, total: int) -> None:
        """``total`` pieces of work will follow."""

    def advance(self, what: str = "") -> None:
        """One piece is done; ``what`` names the next (or the one done) in the bar's text."""


#: The bar of library calls and of commands whose bar is off.
NO_PROGRESS = ProgressBar()


class _RichBar(ProgressBar):
    def __init__(self, progress, description: str):
        self._progress, self._description = progress, description
        self._task = progress.add_task(description, total=None)

    def start(self, total: int) -> None:
        self._progress.update(self._task, total=total)

    def advance(self, what: str = "") -> None:
        text = f"{self._description} {what}".rstrip()
        self._progress.update(self._task, advance=1, description=text)


@contextlib.contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator[ProgressBar]:
    """A rich progress bar on stderr while the block runs, when ``enabled`` and stderr is a terminal (else
    ``NO_PROGRESS``). Lines the block writes to stderr are printed above the bar; stdout is left alone."""
    console = progress_console() if enabled else None
    if console is None:
        yield NO_PROGRESS
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, redirect_stdout=False, redirect_stderr=True) as progress:
        yield _RichBar(progress, description)
