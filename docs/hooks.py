"""MkDocs hooks: the pages that must not drift from the code and the repository are written at build time.

- ``model-families.md``: the ``<!-- MODEL_FAMILIES_TABLE -->`` marker is replaced by a table generated from
  ``liger_gen.integrations.transformers.MODEL_FAMILIES`` (one row per family, from its ``ModelFamily`` fields).
- ``benchmarks-results.md``: the repository's ``BENCHMARKS.md``, read when the site is built. Its links into the
  repository (result folders, scripts) have no page in the site, so they are shown as paths, not links.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- MODEL_FAMILIES_TABLE -->"

NORMS = {"llama": "RMSNorm (`w · x̂`, x̂ rounded to the input's dtype first)",
         "gemma": "(1 + w) RMSNorm in fp32", "fp32": "RMSNorm in fp32", "layer": "LayerNorm", None: "not patched"}
ROPE_TABLES = {"full": "", "half": "half-width tables", "interleaved": "interleaved tables",
               "complex": "complex `freqs_cis`"}
LOGITS = {None: "✓", "softcap": "✓ soft-capped", "divide": "✓ ÷ `logits_scaling`", "multiply": "✓ × `logit_scale`",
          "lm_head_multiplier": "✓ × `lm_head_multiplier`"}
GATES = {None: "", "clamped_swiglu": "experts' clamped SwiGLU gate", "batched": "experts' gate between their `bmm`"}


def _rope(family) -> str:
    if not family.rope:
        return "not patched"
    parts = [ROPE_TABLES[family.rope_tables]]
    if family.rope_pairs:
        parts.append("interleaved pairs")
    if family.interleaved_rope:
        parts.append(f"and `{family.interleaved_rope}` (de-interleaved)")
    detail = ", ".join(p for p in parts if p)
    return f"✓ ({detail})" if detail else "✓"


def family_table() -> str:
    """The Markdown table of every family in ``MODEL_FAMILIES``, in its order."""
    from liger_gen.integrations.transformers import MODEL_FAMILIES

    rows = ["| `model_type` | causal-LM class | norms | RoPE | gated MLP | loss (logit transform) | left as transformers' |",
            "|---|---|---|---|---|---|---|"]
    for family in MODEL_FAMILIES.values():
        norms = NORMS[family.norm]
        if family.norm is not None:
            norms += " · " + ", ".join(f"`{c}`" for c in family.norm_class_names)
        mlp = "✓" if family.mlp else "not patched"
        if family.experts_gate:
            mlp += f", {GATES[family.experts_gate]}"
        rows.append(f"| {family.model_type} | {', '.join(f'`{c}`' for c in family.causal_lm_classes)} | {norms} | "
                    f"{_rope(family)} | {mlp} | {LOGITS[family.logits]} | {family.note} |")
    return "\n".join(rows) + f"\n\n{len(MODEL_FAMILIES)} families.\n"


_REPO_LINK = re.compile(r"(!?)\[([^\]]*)\]\((?!https?://|mailto:|#)([^)\s]+)\)")


def _unlink(match: re.Match) -> str:
    image, text, target = match.groups()
    if image:
        return f"(image in the repository: `{target}`)"
    return f"{text} (`{target}`)" if f"`{target}`" != text.strip() else text


def on_files(files, config):
    content = _REPO_LINK.sub(_unlink, (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))
    files.append(File.generated(config, "benchmarks-results.md", content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "model-families.md":
        if MARKER not in markdown:
            raise ValueError(f"docs/model-families.md lost its {MARKER} marker")
        return markdown.replace(MARKER, family_table())
    return markdown
