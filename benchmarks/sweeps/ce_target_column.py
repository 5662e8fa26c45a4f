"""Cross-entropy's gradient-writing kernel at 8192 x 128256 bf16: where 1 − p_y is summed apart from the target.

The kernel keeps 1 − p_y = Σ_{j≠y} p_j apart from the target's term so that a confident row's tiny gradient
and loss stay accurate. The template of an earlier commit (``--old``, a file) did it in the first pass, with a
compare in every tile; the current one sums every column in the first pass and forms the sum in the second,
from the p it computes anyway (leaving out the target's tile, which it reads once more first), then rewrites the
target column after a barrier. (A variant with a compare per column in the second pass instead of the extra
tile read, timed by this script at commit dedc931, was slower at every tile but 16384 columns on 16 warps.) This times both
templates' training step (the op benchmark's measure: GPU kernel time from torch.profiler, mean of 20 calls,
every kernel of the step) over vocab tile, warps and L2 hints, beside Liger-Kernel's kernel and a copy of the
logits, and runs the tuner's gate (float64 reference) on every new variant. Needs CUDA.

    git show <commit>:liger_gen/templates/cross_entropy.py.jinja > /tmp/ce_old.py.jinja
    python benchmarks/sweeps/ce_target_column.py --old /tmp/ce_old.py.jinja
"""
import argparse
import sys
from pathlib import Path

import jinja2
import torch

sys.path.insert(0, str(Path(__file__).parent))
from ce_l2_tiles import kernel_ms, show  # noqa: E402

from liger_gen.codegen import render  # noqa: E402
from liger_gen.codegen.build import load_variant  # noqa: E402
from liger_gen.ops.lm_head.cross_entropy import CrossEntropyProblem  # noqa: E402

ROWS, VOCAB = 8192, 128256
TILES = ((2048, 4), (4096, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32))


def with_template(text):
    """Render cross_entropy from ``text`` (None: the package's file) in the load_variant calls that follow."""
    name = "cross_entropy" + render.TEMPLATE_SUFFIX
    env = render._environment()
    if text is None:
        env.loader = jinja2.PackageLoader("liger_gen", "templates")
    else:
        env.loader = jinja2.ChoiceLoader([jinja2.DictLoader({name: text}),
                                          jinja2.PackageLoader("liger_gen", "templates")])
    env.cache = {} if env.cache is not None else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, help="an earlier cross_entropy template to time beside the current one")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; CE {ROWS}x{VOCAB} bf16, training step, "
          "kernel ms per call (profiler, mean of 20)", flush=True)
    p = CrossEntropyProblem(torch.bfloat16, {"vocab": VOCAB}, ROWS, "cuda", seed=0)
    h = p.space.heuristic()
    rows = []
    for label, text in (("current", None), ("old", args.old.read_text() if args.old else None)):
        if label == "old" and text is None:
            continue
        with_template(text)
        for bv, w in TILES:
            for hints in (0, 1):
                c = type(h)(**{**h.to_dict(), "GRAD_IN_FWD": 1, "BLOCK_V_BWD": bv, "num_warps_bwd": w,
                               "L2_HINTS": hints})
                if p.space.violations(c):
                    print(f"  skip {bv}/{w}: {p.space.violations(c)}")
                    continue
                module = load_variant("cross_entropy", p.template_params(c))
                gate = p.check(module, "fwd") if label == "current" else None
                ms = show(f"{label:7s} BV={bv:5d} w={w:2d} hints={hints} gate={'ok' if gate is None else gate}",
                          kernel_ms(p.launcher(module, "fwd")))
                rows.append((ms, label, bv, w, hints))
    with_template(None)
    x0 = p.buffers["logits"]
    target = p.buffers["target"]
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        base = x0.detach().clone().requires_grad_(True)

        def lk():
            x = base.view(ROWS, VOCAB)
            loss = LigerCrossEntropyFunction.apply(x, target, None, -100, 0.0, 0.0, "mean", None)[0]
            return torch.autograd.grad(loss, x)[0]
        rows.append((show("Liger-Kernel forward+backward (in place)", kernel_ms(lk)), "liger-kernel", 0, 0, 0))
    except ImportError as e:
        print("Liger-Kernel missing:", e)
    out = torch.empty_like(x0)
    copy = show("copy of the logits (one read + one write)", kernel_ms(lambda: out.copy_(x0)))
    print("\nbest per template (ms, x of the copy):")
    for label in ("current", "old", "liger-kernel"):
        mine = sorted(r for r in rows if r[1] == label)
        if mine:
            ms, _, bv, w, hints = mine[0]
            print(f"  {label:15s} {ms:.4f}  {ms / copy:.3f}x  BV={bv} w={w} hints={hints}")


if __name__ == "__main__":
    main()
