"""Render Triton kernel modules from the Jinja templates in ``liger_gen/templates``.

Rendering is a pure function of (template source, params): the environment uses ``StrictUndefined`` so a
missing variable is an error, the params are embedded as sorted JSON, and nothing time- or host-dependent is
written. The template's source hash (covering the shared macro files it imports) is part of every tuned-table
key, so editing a template invalidates the entries tuned with the old text.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import resources
from typing import Any, Mapping

import jinja2
import jinja2.meta

TEMPLATE_SUFFIX = ".py.jinja"


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    """The one Jinja environment: templates from the package, undefined variables are errors."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("liger_gen", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


@functools.lru_cache(maxsize=None)
def template_source(op: str) -> str:
    """Source text of the template family for ``op`` (e.g. ``"rms_norm"``); FileNotFoundError if absent."""
    return _file_text(f"{op}{TEMPLATE_SUFFIX}")


def _file_text(name: str) -> str:
    return (resources.files("liger_gen") / "templates" / name).read_text(encoding="utf-8")


def template_files(op: str) -> tuple[str, ...]:
    """The template file of ``op`` and every file it imports or includes, directly or not, in a fixed order."""
    seen: list[str] = []
    todo = [f"{op}{TEMPLATE_SUFFIX}"]
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        referenced = jinja2.meta.find_referenced_templates(_environment().parse(_file_text(name)))
        todo += sorted(r for r in referenced if r is not None)  # None: a name computed at render time (unused)
    return tuple(seen)


@functools.lru_cache(maxsize=None)
def template_hash(op: str) -> str:
    """sha256 (hex, 16 chars) of the template source and of every file it imports or includes (shared macros):
    tuned tables record it, so editing a shared piece retires the entries of every op that uses it."""
    own, *imported = template_files(op)
    digest = hashlib.sha256(_file_text(own).encode("utf-8"))  # a template without imports: the hash of its text
    for name in imported:
        digest.update(b"\0" + name.encode("utf-8") + b"\0" + _file_text(name).encode("utf-8"))
    return digest.hexdigest()[:16]


def source_hash(source: str) -> str:
    """sha256 (hex, 32 chars) of a rendered module; names the module in the kernel cache."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:32]


def render(op: str, params: Mapping[str, Any]) -> str:
    """Render one variant of ``op`` as Python source.

    ``params`` must hold every variable the template uses (JSON-serialisable scalars); jinja2.UndefinedError
    names a missing one. The same params always give the same text.
    """
    variant = dict(sorted(params.items()))
    variant_json = json.dumps(variant, sort_keys=True, separators=(",", ":"))
    template = _environment().get_template(f"{op}{TEMPLATE_SUFFIX}")
    return template.render(**variant, variant_json=variant_json)
