"""The docs site: every python example of docs/getting-started.md runs as written (in this process's mode: the
interpreter without a GPU, with tiny models), and ``mkdocs build --strict`` passes (skipped without MkDocs unless
LIGER_GEN_REQUIRE_MKDOCS=1, as in .ci/run)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import preference_batch

ROOT = Path(__file__).resolve().parent.parent
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
README = ROOT / "README.md"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


@pytest.fixture(autouse=True)
def _restore_rope():
    """The examples call apply_to, whose RoPE routing is process-wide: undo it for the tests that follow."""
    yield
    from liger_gen.integrations.transformers import restore_rope

    restore_rope()


def _names(corpus, tmp_path):
    """What the examples take from the reader's own code: a model folder with its tokenizer and a dataset
    (``model_name``, ``dataset``), and for the post-training losses tiny Llamas as policy, reference, student and
    teacher (the teacher wider) with a batch of two chosen/rejected pairs."""
    import torch
    import transformers

    tokenizer, dataset = corpus

    def llama(hidden, seed, vocab=97):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                          max_position_embeddings=128, pad_token_id=0, eos_token_id=1)
        return transformers.LlamaForCausalLM(config)

    model_dir = tmp_path / "tiny-llama"
    llama(64, 0, vocab=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {"model_name": str(model_dir), "dataset": dataset.select(range(16)), **preference_batch(llama)}


def test_getting_started_has_the_three_examples():
    blocks = python_blocks(GETTING_STARTED)
    assert len(blocks) >= 3, "docs/getting-started.md lost an example"
    assert "apply_to" in blocks[0] and any("SFTTrainer" in b for b in blocks) and any("fused_linear_dpo" in b for b in blocks)


def test_readme_examples_are_getting_started_examples():
    """The README's python examples are the ones this file runs (so the README's Trainer example runs too)."""
    docs = python_blocks(GETTING_STARTED)
    for block in python_blocks(README):
        assert block in docs, f"README example not in docs/getting-started.md:\n{block}"


@pytest.mark.parametrize("index", range(len(python_blocks(GETTING_STARTED))))
def test_getting_started_example_runs(index, corpus, tmp_path, monkeypatch):
    import torch

    pytest.importorskip("transformers")
    block = python_blocks(GETTING_STARTED)[index]
    uses_trl = "trl" in block
    if uses_trl:
        trl = pytest.importorskip("trl")
        import functools

        # the CPU run of the docs' paragraph below the example (tests/test_trl.py's settings), two steps
        monkeypatch.setattr(trl, "SFTConfig", functools.partial(
            trl.SFTConfig, use_cpu=not torch.cuda.is_available(), report_to=[], max_length=64, max_steps=2,
            per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0))
    if uses_trl or "fused_linear_dpo" in block:  # the trainer and the losses on the plain CPU path, as test_trl does
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.chdir(tmp_path)  # the trainer's output_dir
    namespace = _names(corpus, tmp_path) if ("model_name" in block or "policy" in block) else {}
    exec(compile(block, f"{GETTING_STARTED}:example {index}", "exec"), namespace)
    if "labels=ids" in block:
        assert namespace["model"].lm_head.weight.grad is not None  # the loss reached the LM head without logits
        assert namespace["y"].shape == namespace["x"].shape and namespace["loss"].ndim == 0
    if "SFTTrainer" in block:
        losses = [h["loss"] for h in namespace["trainer"].state.log_history if "loss" in h]
        assert namespace["trainer"].state.global_step > 0 and all(map(lambda v: v == v, losses))
    if "fused_linear_dpo" in block:
        assert torch.isfinite(namespace["out"].loss) and namespace["policy"].lm_head.weight.grad is not None
        assert namespace["out"].chosen_rewards.shape == (2,)
        assert torch.isfinite(namespace["loss"]) and namespace["loss"] > 0


DOCS = ROOT / "docs"
GENERATED = re.compile(r"<!-- generated: [^>]*-->\n(.*?)<!-- /generated -->", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The Markdown without its fenced code blocks (their brackets are code, not links)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_each_page_reads_as_plain_markdown_in_the_repository(page):
    """Read on GitHub, before any build step: every relative link and image leads to a file of the repository, no
    mkdocstrings directive shows as text, and each region the site generates holds a sentence with a link."""
    text = (DOCS / page).read_text(encoding="utf-8")
    prose = _prose(text)
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (DOCS / target.split("#")[0]).exists(), f"{page}: link to {target}, which is not in the repository"
    assert not re.search(r"^:::", prose, re.M), f"{page}: a mkdocstrings directive outside a generated region"
    for static in GENERATED.findall(text):
        assert len(static.split()) >= 8 and LINK.search(static), f"{page}: a generated region without its sentence"


def test_the_home_page_shows_the_headline_figure():
    assert "](assets/headline.png)" in (DOCS / "index.md").read_text(encoding="utf-8")
    assert (DOCS / "assets" / "headline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        if os.environ.get("LIGER_GEN_REQUIRE_MKDOCS") == "1":
            pytest.fail("LIGER_GEN_REQUIRE_MKDOCS=1 but MkDocs is not installed: pip install -e '.[docs]'")
        pytest.skip("MkDocs is not installed (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    families = (tmp_path / "site" / "model-families" / "index.html").read_text(encoding="utf-8")
    from liger_gen.integrations.transformers import MODEL_FAMILIES

    assert all(f"<td>{name}</td>" in families for name in MODEL_FAMILIES)  # the generated table, every family
    ops = (tmp_path / "site" / "ops" / "index.html").read_text(encoding="utf-8")
    assert 'id="liger_gen.functional.rms_norm"' in ops and 'id="liger_gen.nn.RMSNorm"' in ops
    assert "are rendered here" not in ops  # the static sentence gave way to the generated reference
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert 'src="assets/headline.png"' in home
    results = (tmp_path / "site" / "benchmarks-results" / "index.html").read_text(encoding="utf-8")
    first_heading = next(line for line in (ROOT / "BENCHMARKS.md").read_text().splitlines() if line.startswith("# "))
    assert first_heading[2:].split(":")[0] in results and "the docs site shows" not in results


def test_every_warning_troubleshooting_names_is_importable_from_the_package_and_filters():
    """Each warning class docs/troubleshooting.md names is a ``UserWarning`` subclass importable from ``liger_gen``,
    and the filter the page shows silences that class and no other."""
    import warnings

    import liger_gen

    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    names = sorted(set(re.findall(r"`(\w+Warning)`", text)) - {"UserWarning"})
    assert len(names) >= 5, names
    for name in names:
        cls = getattr(liger_gen, name)
        assert issubclass(cls, UserWarning) and cls.__name__ == name and name in dir(liger_gen)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", category=cls)
            warnings.warn("liger-gen: silenced", cls)
            warnings.warn("liger-gen: shown", UserWarning)
        assert [str(w.message) for w in seen] == ["liger-gen: shown"], name


@pytest.mark.parametrize("index", range(len(python_blocks(ROOT / "docs" / "model-families.md"))))
def test_model_families_example_runs(index):
    """The vision-language examples of docs/model-families.md run as written: patched, a training step on their
    image batch, the loss from the hidden states (no logits) and a gradient on the vision tower."""
    block = python_blocks(ROOT / "docs" / "model-families.md")[index]
    namespace = {}
    exec(compile(block, f"model-families.md[{index}]", "exec"), namespace)
    model, out = namespace["model"], namespace["out"]
    assert out.logits is None and model.liger_gen_report.loss
    vision = [p for name, p in model.named_parameters() if "vision" in name or "visual" in name]
    assert vision and any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision)
