"""The rich console of the command line's reports (``verify``, ``show``, the end of a tuning run).

On a terminal rich fits the output to the terminal's width. Anywhere else (a pipe, a log file, CI, a test runner)
there is no width to fit: a console of ``NO_TTY_WIDTH`` columns keeps every table row and message on one line, so
that a path, a number or a command is never folded across lines (rich's default there is 80 columns)."""

from __future__ import annotations

import sys

from rich.console import Console

#: Columns of a console that does not write to a terminal: wider than any table row the reports print.
NO_TTY_WIDTH = 10_000


def output_console() -> Console:
    """A console for stdout: the terminal's width on a terminal, else ``NO_TTY_WIDTH`` columns (no wrapping)."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stdout
        tty = False
    return Console() if tty else Console(width=NO_TTY_WIDTH)
