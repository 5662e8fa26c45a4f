"""``--json``: every ``liger-gen`` command can print one JSON document on stdout instead of its tables.

The document has the same keys for every command (``SCHEMA``)::

    {"schema": "liger-gen/cli/1", "command": "bench", "ok": true, "exit_code": 0,
     "error": null | {"kind": "usage" | "no-gpu" | "error", "message": str, "param": str | null, "hints": [str]},
     "files": {"json": "bench-results/.../bench_tiny_cpu.json", ...},
     "result": {...what the command measured, checked or listed...}}

Under ``--json`` stdout holds that document and nothing else: whatever the command and the library print while it
runs (progress lines, notices, a tuning run's log) goes to stderr, and no progress bar is drawn. A command that
fails, a usage error included, prints the document with ``ok: false`` and its ``error`` (``hints``: the commands
its message suggests), then exits with the same status as without ``--json`` (1, or 2 for a usage error).
Non-finite floats are written as null, so the document is strict JSON.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import click

SCHEMA = "liger-gen/cli/1"
_STDOUT = "liger_gen.stdout"  # ctx.meta key: the real stdout while the command's own output goes to stderr
_JSON = "liger_gen.json"  # ctx.meta key: --json was given
HINT = re.compile(r"`([^`]*liger-gen [^`]*)`")


class NeedsGPU(click.ClickException):
    """A command that needs a GPU ran without one; its message says what to run instead (``kind: no-gpu``)."""


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats as None, paths as strings and tuples as lists (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


def document(command: str, *, result: Any = None, files: dict[str, Any] | None = None, exit_code: int = 0,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The document of one command run (keys in the module docstring)."""
    return {"schema": SCHEMA, "command": command, "ok": exit_code == 0 and error is None, "exit_code": exit_code,
            "error": error, "files": {k: None if v is None else str(v) for k, v in (files or {}).items()},
            "result": result}


def error_document(command: str, exc: click.ClickException) -> dict[str, Any]:
    usage = isinstance(exc, click.UsageError)
    param = getattr(exc, "param_hint", None) or (exc.param.opts[0] if getattr(exc, "param", None) else None)
    if isinstance(param, (list, tuple)):
        param = " / ".join(param)
    message = exc.format_message()
    kind = "usage" if usage else "no-gpu" if isinstance(exc, NeedsGPU) else "error"
    return document(command, exit_code=exc.exit_code,
                    error={"kind": kind, "message": message, "param": param.strip("'\"") if param else None,
                           "hints": hints(command, message)})


def hints(command: str, message: str) -> list[str]:
    """The commands a message suggests (in backticks), less a bare mention of the command that failed."""
    return [h for h in HINT.findall(" ".join(message.split())) if h.strip() != f"liger-gen {command}"]


def emit(doc: dict[str, Any]) -> None:
    """Print ``doc`` as one JSON document on the real stdout (the one the command started with)."""
    meta = click.get_current_context().meta
    out = meta.get(_STDOUT) or sys.stdout
    out.write(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n")
    out.flush()


def finish(as_json: bool, command: str, result: Any = None, files: dict[str, Any] | None = None,
           exit_code: int = 0) -> None:
    """The end of a command: under --json its document; then the exit status (``sys.exit`` when not 0)."""
    if as_json:
        emit(document(command, result=result, files=files, exit_code=exit_code))
    if exit_code:
        sys.exit(exit_code)


def wants_json(args: list[str]) -> bool:
    """Whether a command line (after the program name) asks for --json."""
    return "--json" in args


@contextlib.contextmanager
def json_mode(ctx: click.Context, enabled: bool) -> Iterator[None]:
    """While a command runs under --json: stdout goes to stderr (the document is written to the real stdout by
    ``emit``), and a ClickException (usage errors included) prints its error document before click reports it."""
    if not enabled:
        yield
        return
    ctx.meta[_JSON] = True
    ctx.meta[_STDOUT] = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except click.ClickException as exc:
        emit(error_document(ctx.invoked_subcommand or ctx.info_name or "liger-gen", exc))
        raise


def files_in(folder: Path, *names: str) -> dict[str, str | None]:
    """``{suffix: path}`` of the files ``names`` in ``folder`` that exist (None for those that do not)."""
    return {Path(n).suffix.lstrip("."): (str(folder / n) if (folder / n).exists() else None) for n in names}
