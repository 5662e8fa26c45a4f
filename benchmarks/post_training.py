"""DPO and GRPO losses from hidden states at an LM head: liger-gen vs Liger-Kernel's chunked losses vs the plain
PyTorch formula (eager and torch.compile). Forward + backward time (CUDA events, median) and peak extra memory.

    python benchmarks/post_training.py [--hidden 4096 --vocab 128256 --batch 8 --seq 1024 --iters 10]

Both losses follow TRL's formulas on per-token log-probabilities:

* DPO (sigmoid; Rafailov et al. 2023): ``−log σ(β·((π_c − ref_c) − (π_r − ref_r)))`` with π the summed
  log-probabilities of each completion, the reference's from a frozen head on its own hidden states; chosen and
  rejected are ``batch`` sequences each of ``seq`` tokens (the first eighth of each is prompt, ignored).
* GRPO (Shao et al. 2024) with TRL's "dapo" normalisation: per token ``−min(r·A, clip(r, 1 − ε_l, 1 + ε_h)·A) +
  β·(exp(ref − logp) − (ref − logp) − 1)``, r = exp(logp − old_logp), summed over completion tokens and divided
  by their count; ``batch`` completions of ``seq`` tokens, β 0.04, ε 0.2.

liger-gen: ``liger_gen.functional.selective_log_softmax`` (chunked, tuned kernels) and the formula in PyTorch.
Liger-Kernel: ``LigerFusedLinearDPOLoss`` / ``LigerFusedLinearGRPOLoss`` (their defaults: torch.compile'd chunks).
torch: the full logits in bf16, upcast to fp32, ``log_softmax`` and ``gather``. Every provider's loss and
gradients are compared with the eager ones (relative L2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

import liger_gen

BETA_DPO, BETA_GRPO, EPS = 0.1, 0.04, 0.2


def token_logps_torch(x, w, target):
    logits = (x @ w.t()).float()
    logp = logits.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return torch.where(target != -100, logp, 0.0)


def dpo_from_logps(logp, ref_logp):
    c, r = logp.sum(-1).chunk(2)
    rc, rr = ref_logp.sum(-1).chunk(2)
    return -F.logsigmoid(BETA_DPO * ((c - rc) - (r - rr))).mean()


def grpo_from_logps(logp, old, ref, adv, mask):
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(1 - EPS, 1 + EPS) * adv[:, None])
    per_token = per_token + BETA_GRPO * (torch.exp(ref - logp) - (ref - logp) - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def providers(kind: str):
    lg = liger_gen.functional.selective_log_softmax
    out = {}
    if kind == "dpo":
        def eager(t):
            with torch.no_grad():
                ref = token_logps_torch(t["ref_x"], t["ref_w"], t["target"])
            return dpo_from_logps(token_logps_torch(t["x"], t["w"], t["target"]), ref)

        def ours(t):
            with torch.no_grad():
                ref = lg(t["ref_x"], t["ref_w"], t["target"])
            return dpo_from_logps(lg(t["x"], t["w"], t["target"]), ref)

        def liger():
            from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

            loss = LigerFusedLinearDPOLoss(beta=BETA_DPO)
            return lambda t: _first(loss(t["w"], t["x"], t["target"], ref_input=t["ref_x"], ref_weight=t["ref_w"]))
    else:
        def eager(t):
            logp = token_logps_torch(t["x"], t["w"], t["target"])
            return grpo_from_logps(logp, t["old"], t["ref"], t["adv"], t["mask"])

        def ours(t):
            return grpo_from_logps(lg(t["x"], t["w"], t["target"]), t["old"], t["ref"], t["adv"], t["mask"])

        def liger():
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            loss = LigerFusedLinearGRPOLoss(beta=BETA_GRPO, epsilon_low=EPS, epsilon_high=EPS, loss_type="dapo")
            return lambda t: _first(loss(t["x"], t["w"], t["ids"], t["mask"], t["adv"], ref_per_token_logps=t["ref"],
                                         old_per_token_logps=t["old"]))
    out["torch-eager"] = eager
    out["torch-compile"] = torch.compile(eager)
    out["liger-gen"] = ours
    try:
        out["liger-kernel"] = liger()
    except ImportError as exc:
        print(f"[post_training] liger-kernel not available: {exc}", file=sys.stderr)
    return out


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def make_inputs(kind, args, device):
    gen = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16
    b = 2 * args.batch if kind == "dpo" else args.batch
    s, h, v = args.seq, args.hidden, args.vocab

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(bf)

    t = {"x": randn(b, s, h), "w": randn(v, h, scale=2.0 / h ** 0.5)}
    ids = torch.randint(0, v, (b, s), generator=gen, device=device)
    prompt = s // 8
    t["target"] = ids.clone()
    t["target"][:, :prompt] = -100
    if kind == "dpo":
        t["ref_x"] = (t["x"].float() + 0.1 * torch.randn(t["x"].shape, generator=gen, device=device)).to(bf)
        t["ref_w"] = t["w"].clone()
    else:
        t["ids"] = ids
        t["mask"] = (t["target"] != -100).to(torch.int64)
        with torch.no_grad():
            logp = token_logps_torch(t["x"], t["w"], t["target"])
        t["old"] = (logp + 0.05 * torch.randn(logp.shape, generator=gen, device=device)).detach()
        t["ref"] = (logp + 0.05 * torch.randn(logp.shape, generator=gen, device=device)).detach()
        t["adv"] = torch.randn(b, generator=gen, device=device)
    return t


def step(fn, t):
    x, w = t["x"].detach().requires_grad_(), t["w"].detach().requires_grad_()
    loss = fn({**t, "x": x, "w": w})
    dx, dw = torch.autograd.grad(loss, (x, w))
    return loss.detach(), dx, dw


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    rows = []
    for kind in ("dpo", "grpo"):
        t = make_inputs(kind, args, device)
        provs = providers(kind)
        ref_loss, ref_dx, ref_dw = step(provs["torch-eager"], t)
        for name, fn in provs.items():
            for _ in range(3):
                step(fn, t)
            torch.cuda.synchronize()
            times = []
            for _ in range(args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = step(fn, t)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
                del out
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss, dx, dw = step(fn, t)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            row = {"loss": kind, "provider": name, "ms": statistics.median(times), "ms_all": times,
                   "peak_extra_mib": peak, "loss_value": loss.item(), "rel_loss": rel(loss, ref_loss),
                   "rel_dx": rel(dx, ref_dx), "rel_dw": rel(dw, ref_dw)}
            rows.append(row)
            del loss, dx, dw
        del t
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "args": vars(args)}
    try:
        from importlib.metadata import version

        meta["liger-kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001 - informative only
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(meta)
    by = {(r["loss"], r["provider"]): r for r in rows}
    print(f"{'loss':5s} {'provider':14s} {'fwd+bwd ms':>10s} {'peak extra MiB':>15s} {'vs liger':>9s} "
          f"{'rel loss':>9s} {'rel dx':>9s} {'rel dW':>9s}")
    for r in rows:
        lk = by.get((r["loss"], "liger-kernel"))
        ratio = f"{r['ms'] / lk['ms']:.2f}x" if lk else "-"
        print(f"{r['loss']:5s} {r['provider']:14s} {r['ms']:10.2f} {r['peak_extra_mib']:15.0f} {ratio:>9s} "
              f"{r['rel_loss']:9.1e} {r['rel_dx']:9.1e} {r['rel_dw']:9.1e}")


if __name__ == "__main__":
    main()
