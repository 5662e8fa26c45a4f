"""MkDocs hooks: the pages that must not drift from the code and the repository are written at build time.

A page's generated part is a region between ``<!-- generated: KIND [ARG] -->`` and ``<!-- /generated -->``. In
the repository the region holds a short sentence with a link to the source of truth, so the page reads fine as
raw Markdown (on GitHub); when the site is built the region is replaced by what it stands for:

- ``families``: a table generated from ``liger_gen.integrations.transformers.MODEL_FAMILIES`` (one row per
  family, from its ``ModelFamily`` fields), in ``model-families.md``;
- ``api MODULE``: mkdocstrings' reference of ``MODULE`` (its signatures and docstrings), in ``ops.md``;
- ``benchmarks``: the repository's ``BENCHMARKS.md``, in ``benchmarks-results.md``. Its links into the
  repository (result folders, scripts) have no page in the site, so they are shown as paths, not links.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = re.compile(r"<!-- generated: (\w[\w-]*)(?: ([\w.]+))? -->\n.*?<!-- /generated -->", re.S)
#: mkdocstrings' options per module of an ``api`` region
API_OPTIONS = {"liger_gen.functional": {"show_root_heading": "false", "members_order": "alphabetical"},
               "liger_gen.nn": {"show_root_heading": "false"}, "liger_gen.optim": {"show_root_heading": "false"}}
#: the generated regions each page must keep (a page that lost one fails the build)
REQUIRED = {"model-families.md": {"families"}, "ops.md": {"api"}, "benchmarks-results.md": {"benchmarks"}}

NORMS = {"llama": "RMSNorm (`w · x̂`, x̂ rounded to the input's dtype first)",
         "gemma": "(1 + w) RMSNorm in fp32", "fp32": "RMSNorm in fp32", "layer": "LayerNorm",
         "layer1p": "(1 + w) LayerNorm", None: "not patched"}
ROPE_TABLES = {"full": "", "half": "half-width tables", "interleaved": "interleaved tables",
               "complex": "complex `freqs_cis`"}
LOGITS = {None: "✓", "softcap": "✓ soft-capped", "divide": "✓ ÷ `logits_scaling`", "multiply": "✓ × `logit_scale`",
          "lm_head_multiplier": "✓ × `lm_head_multiplier`"}
GATES = {None: "", "clamped_swiglu": "experts' clamped SwiGLU gate", "batched": "experts' gate between their `bmm`"}


def _describe(table: dict, value, field: str) -> str:
    """``table[value]``, or a build error that names the ``ModelFamily`` field whose new value needs a description."""
    if value not in table:
        raise ValueError(f"docs/hooks.py describes no ModelFamily.{field} {value!r}: add it to the table of {field}")
    return table[value]


def _rope(family) -> str:
    if not family.rope:
        return "not patched"
    parts = [_describe(ROPE_TABLES, family.rope_tables, 'rope_tables')]
    if family.rope_pairs:
        parts.append("interleaved pairs")
    if family.interleaved_rope:
        parts.append(f"and `{family.interleaved_rope}` (de-interleaved)")
    if family.vision_rope:
        parts.append(f"and the vision tower's `{family.vision_rope}`")
    detail = ", ".join(p for p in parts if p)
    return f"✓ ({detail})" if detail else "✓"


def family_table() -> str:
    """The Markdown table of every family in ``MODEL_FAMILIES``, in its order."""
    from liger_gen.integrations.transformers import MODEL_FAMILIES

    rows = ["| `model_type` | LM class (fused loss) | norms | RoPE | gated MLP | loss (logit transform) | left as transformers' |",
            "|---|---|---|---|---|---|---|"]
    for family in MODEL_FAMILIES.values():
        norms = _describe(NORMS, family.norm, 'norm')
        if family.norm is not None:
            norms += " · " + ", ".join(f"`{c}`" for c in family.norm_class_names)
        mlp = "✓" if family.mlp else "not patched"
        if family.experts_gate:
            mlp += f", {_describe(GATES, family.experts_gate, 'experts_gate')}"
        rows.append(f"| {family.model_type} | {', '.join(f'`{c}`' for c in family.causal_lm_classes)} | {norms} | "
                    f"{_rope(family)} | {mlp} | {_describe(LOGITS, family.logits, 'logits')} | {family.note} |")
    return "\n".join(rows) + f"\n\n{len(MODEL_FAMILIES)} families.\n"


_REPO_LINK = re.compile(r"(!?)\[([^\]]*)\]\((?!https?://|mailto:|#)([^)\s]+)\)")


def _unlink(match: re.Match) -> str:
    image, text, target = match.groups()
    if image:
        return f"(image in the repository: `{target}`)"
    return f"{text} (`{target}`)" if f"`{target}`" != text.strip() else text


def benchmarks_page() -> str:
    """``BENCHMARKS.md`` with its links into the repository shown as paths."""
    return _REPO_LINK.sub(_unlink, (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))


def api_reference(module: str) -> str:
    """mkdocstrings' directive for ``module``, with its options."""
    options = API_OPTIONS.get(module, {})
    lines = [f"::: {module}"] + (["    options:"] + [f"      {k}: {v}" for k, v in options.items()] if options else [])
    return "\n".join(lines) + "\n"


def _generated(match: re.Match) -> str:
    kind, arg = match.groups()
    if kind == "families":
        return family_table()
    if kind == "api" and arg:
        return api_reference(arg)
    if kind == "benchmarks":
        return benchmarks_page()
    raise ValueError(f"unknown generated region {match.group(0).splitlines()[0]!r}")


def on_page_markdown(markdown, page, config, files):
    kinds = {m.group(1) for m in GENERATED.finditer(markdown)}
    missing = REQUIRED.get(page.file.src_uri, set()) - kinds
    if missing:
        raise ValueError(f"docs/{page.file.src_uri} lost its generated region(s) {sorted(missing)}")
    return GENERATED.sub(_generated, markdown)
