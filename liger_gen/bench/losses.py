"""Post-training losses from hidden states at an LM head: liger-gen vs Liger-Kernel's chunked losses vs the
plain PyTorch formula (eager and torch.compile). Forward + backward time (CUDA events, median) and peak extra
memory, every provider's loss and gradients compared with the eager ones (relative L2).

    liger-gen bench-losses [--hidden 4096 --vocab 128256 --batch 8 --seq 1024 --iters 10]
                           [--losses dpo,orpo,cpo,simpo,kto,grpo,jsd] [--out DIR]

Shapes: ``batch`` sequences of ``seq`` tokens per side (DPO, ORPO, CPO, SimPO: ``batch`` chosen and ``batch``
rejected; KTO: ``batch`` sequences, half desirable; GRPO: ``batch`` completions; JSD: ``batch`` sequences for
student and teacher), the first eighth of each sequence a prompt (ignored), bf16 activations and heads.

Losses (the formulas of TRL's trainers, ``liger_gen.ops.lm_head.post_training``): DPO sigmoid (β 0.1, a reference head
on its own hidden states); ORPO (β 0.1, NLL of the chosen completions); CPO sigmoid (β 0.1, + 1.0·NLL); SimPO
(β 0.1, γ 0.5, + 1.0·NLL, as Liger-Kernel's defaults); KTO (β 0.1, reference head, KL estimate 0); GRPO with
TRL's "dapo" normalisation, β 0.04, ε 0.2; the generalised JSD (β 0.5) between a student and a teacher head.

liger-gen: ``liger_gen.functional.fused_linear_*`` (DPO: also ``selective_log_softmax`` with the formula in
PyTorch, "liger-gen-logps"). Liger-Kernel: its ``LigerFusedLinear*Loss`` modules with their defaults
(torch.compile'd chunks; JSD with ``weight_hard_loss=0``). torch: the full logits in bf16, upcast to fp32,
``log_softmax`` and ``gather``, then the formula.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import liger_gen
from liger_gen.bench.labels import label
from liger_gen.console import NO_PROGRESS, ProgressBar
from liger_gen.files import write_atomic, write_results
from liger_gen.ops.lm_head import post_training as P
from liger_gen.reference import fused_linear_jsd_torch

F = liger_gen.functional
BETA, BETA_GRPO, EPS = 0.1, 0.04, 0.2
LOSSES = ("dpo", "orpo", "cpo", "simpo", "kto", "grpo", "jsd")


def token_logps_torch(x, w, target):
    logits = (x @ w.t()).float()
    logp = logits.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return torch.where(target != -100, logp, 0.0)


def _halves(v):
    return v.chunk(2)


def _nll(logp, target):
    chosen, _ = _halves(logp)
    mask = (_halves(target)[0] != -100).float()
    return -(chosen * mask).sum() / mask.sum()


def _means(logp, target):
    mask = (target != -100).float()
    return (logp * mask).sum(-1) / mask.sum(-1)


def eager_loss(kind, t):
    """The plain PyTorch loss of ``kind`` on the full logits."""
    if kind == "jsd":
        return fused_linear_jsd_torch(t["x"], t["w"], t["tx"], t["tw"], t["target"], 0.5)
    logp = token_logps_torch(t["x"], t["w"], t["target"])
    if kind == "dpo":
        with torch.no_grad():
            ref = token_logps_torch(t["ref_x"], t["ref_w"], t["target"]).sum(-1)
        (c, r), (rc, rr) = _halves(logp.sum(-1)), _halves(ref)
        return P.dpo_loss(c, r, rc, rr, BETA).mean()
    if kind == "orpo":
        c, r = _halves(_means(logp, t["target"]))
        return _nll(logp, t["target"]) - P.orpo_loss(c, r, BETA).mean()
    if kind in ("cpo", "simpo"):
        seq = _means(logp, t["target"]) if kind == "simpo" else logp.sum(-1)
        c, r = _halves(seq)
        return P.cpo_loss(c, r, BETA, "simpo" if kind == "simpo" else "sigmoid").mean() + _nll(logp, t["target"])
    if kind == "kto":
        with torch.no_grad():
            ref = token_logps_torch(t["ref_x"], t["ref_w"], t["target"]).sum(-1)
        return P.kto_loss(logp.sum(-1), ref, t["desirable"], 0.0, BETA).mean()
    return P.grpo_loss(logp, t["old"], t["ref"], t["adv"], t["mask"], BETA_GRPO, EPS, EPS, "dapo")


def ours(kind, t):
    x, w, target = t["x"], t["w"], t["target"]
    if kind == "dpo":
        return F.fused_linear_dpo(x, w, target, t["ref_x"], t["ref_w"], beta=BETA).loss
    if kind == "orpo":
        return F.fused_linear_orpo(x, w, target, beta=BETA).loss
    if kind == "cpo":
        return F.fused_linear_cpo(x, w, target, beta=BETA, cpo_alpha=1.0).loss
    if kind == "simpo":
        return F.fused_linear_simpo(x, w, target, beta=BETA, simpo_gamma=0.5, cpo_alpha=1.0).loss
    if kind == "kto":
        return F.fused_linear_kto(x, w, target, t["desirable"], t["ref_x"], t["ref_w"], beta=BETA).loss
    if kind == "jsd":
        return F.fused_linear_jsd(x, w, t["tx"], t["tw"], target, beta=0.5)
    return F.fused_linear_grpo(x, w, target, t["adv"], t["mask"], t["old"], t["ref"], beta=BETA_GRPO,
                               epsilon_low=EPS, epsilon_high=EPS, loss_type="dapo").loss


def dpo_on_logps(t):
    """DPO on selective_log_softmax: the backward recomputes the logits (four GEMMs per token)."""
    lg = F.selective_log_softmax
    with torch.no_grad():
        ref = lg(t["ref_x"], t["ref_w"], t["target"]).sum(-1)
    (c, r), (rc, rr) = _halves(lg(t["x"], t["w"], t["target"]).sum(-1)), _halves(ref)
    return P.dpo_loss(c, r, rc, rr, BETA).mean()


def liger_kernel(kind):
    import liger_kernel.chunked_loss as L

    if kind == "dpo":
        loss = L.LigerFusedLinearDPOLoss(beta=BETA)
        return lambda t: _first(loss(t["w"], t["x"], t["target"], ref_input=t["ref_x"], ref_weight=t["ref_w"]))
    if kind == "orpo":
        loss = L.LigerFusedLinearORPOLoss(beta=BETA)
        return lambda t: _first(loss(t["w"], t["x"], t["target"]))
    if kind == "cpo":
        loss = L.LigerFusedLinearCPOLoss(beta=BETA, alpha=1.0)
        return lambda t: _first(loss(t["w"], t["x"], t["target"]))
    if kind == "simpo":
        loss = L.LigerFusedLinearSimPOLoss(beta=BETA, alpha=1.0, gamma=0.5)
        return lambda t: _first(loss(t["w"], t["x"], t["target"]))
    if kind == "kto":
        loss = L.LigerFusedLinearKTOLoss(beta=BETA, use_ref_model=True)
        return lambda t: _first(loss(t["x"], t["w"], t["target"], preference_labels=t["desirable"],
                                     ref_input=t["ref_x"], ref_weight=t["ref_w"],
                                     kl=torch.zeros((), device=t["x"].device)))
    if kind == "jsd":
        loss = L.LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5)
        return lambda t: _first(loss(t["x"].flatten(0, 1), t["w"], t["tx"].flatten(0, 1), t["tw"],
                                     t["target"].reshape(-1)))
    loss = L.LigerFusedLinearGRPOLoss(beta=BETA_GRPO, epsilon_low=EPS, epsilon_high=EPS, loss_type="dapo")
    return lambda t: _first(loss(t["x"], t["w"], t["ids"], t["mask"], t["adv"], ref_per_token_logps=t["ref"],
                                 old_per_token_logps=t["old"]))


PROVIDERS = ("torch-eager", "torch-compile", "liger-gen", "liger-gen-logps", "liger-kernel")


def providers(kind: str, names=PROVIDERS):
    """name -> fn(inputs) -> loss for ``kind``, among ``names`` (torch-eager always: the reference);
    liger-gen-logps only for DPO, liger-kernel only where it imports."""
    out = {"torch-eager": lambda t: eager_loss(kind, t)}
    if "torch-compile" in names:
        out["torch-compile"] = torch.compile(out["torch-eager"])
    if "liger-gen" in names:
        out["liger-gen"] = lambda t: ours(kind, t)
    if kind == "dpo" and "liger-gen-logps" in names:
        out["liger-gen-logps"] = dpo_on_logps
    if "liger-kernel" in names:
        try:
            out["liger-kernel"] = liger_kernel(kind)
        except ImportError as exc:
            if not _MISSING:  # said once per process
                print(f"[bench-losses] liger-kernel not available: {exc}", file=sys.stderr)
            _MISSING.append(kind)
    return out


_MISSING: list[str] = []


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def make_inputs(kind, args, device):
    gen = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16
    b = 2 * args.batch if kind in ("dpo", "orpo", "cpo", "simpo") else args.batch
    s, h, v = args.seq, args.hidden, args.vocab

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(bf)

    t = {"x": randn(b, s, h), "w": randn(v, h, scale=2.0 / h ** 0.5)}
    ids = torch.randint(0, v, (b, s), generator=gen, device=device)
    prompt = s // 8
    t["target"] = ids.clone()
    t["target"][:, :prompt] = -100
    if kind in ("dpo", "kto"):
        t["ref_x"] = (t["x"].float() + 0.1 * torch.randn(t["x"].shape, generator=gen, device=device)).to(bf)
        t["ref_w"] = t["w"].clone()
        t["desirable"] = torch.arange(b, device=device) % 2 == 0
    elif kind == "jsd":
        t["tx"] = (t["x"].float() + 0.5 * torch.randn(t["x"].shape, generator=gen, device=device)).to(bf)
        t["tw"] = randn(v, h, scale=2.0 / h ** 0.5)
    elif kind == "grpo":
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


def _meta(settings: dict, device: torch.device) -> dict:
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": __import__("triton").__version__, "settings": settings}
    try:
        from importlib.metadata import version

        meta["liger-kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001 - informative only
        pass
    return meta


def _timed(fn, t, device: torch.device) -> float:
    """Milliseconds of one forward + backward (CUDA events on a GPU, the host clock on the CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(fn, t)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    step(fn, t)
    return (time.perf_counter() - begin) * 1e3


def run_losses(losses=LOSSES, providers_=PROVIDERS, hidden: int = 4096, vocab: int = 128256, batch: int = 8,
               seq: int = 1024, iters: int = 10, warmup: int = 3, device: str = "cuda", json_path=None,
               progress: ProgressBar = NO_PROGRESS) -> dict:
    """Time every provider of every loss (median of ``iters`` after ``warmup`` calls) and compare its loss and
    gradients with torch eager; on CUDA also the peak extra memory of one call (``max_memory_allocated`` minus
    what was allocated before it: dW and dx included). The result dict ({"meta", "rows"}) is written to
    ``json_path`` after every loss, so a run stopped part way keeps what it measured; if the last write fails,
    ``liger_gen.files.ResultsNotWritten`` names the temporary file that holds the results instead. ValueError for
    an unknown loss or provider. On the CPU the result says it is a functional run (``functional_run``,
    ``functional_run_reason``: ``liger_gen.bench.labels``). ``progress`` is advanced once per loss and provider."""
    bad = [k for k in losses if k not in LOSSES] + [p for p in providers_ if p not in PROVIDERS]
    if bad:
        raise ValueError(f"unknown loss or provider {bad}; losses: {', '.join(LOSSES)}; providers: "
                         f"{', '.join(PROVIDERS)}")
    dev = torch.device(device)
    settings = {"losses": list(losses), "providers": list(providers_), "hidden": hidden, "vocab": vocab,
                "batch": batch, "seq": seq, "iters": iters, "warmup": warmup}
    args = type("Shape", (), {"batch": batch, "seq": seq, "hidden": hidden, "vocab": vocab})
    rows = []
    warned = False
    progress.start(len(losses) * len(providers_))
    for i, kind in enumerate(losses):
        t = make_inputs(kind, args, dev)
        if dev.type == "cpu":  # the CPU's bf16 GEMMs are slow and imprecise: a functional run in fp32
            t = {k: v.float() if v.is_floating_point() else v for k, v in t.items()}
        provs = providers(kind, providers_)
        ref_loss, ref_dx, ref_dw = step(provs["torch-eager"], t)
        for name, fn in provs.items():
            if name not in providers_:
                continue
            print(f"[bench-losses] {kind} {name}", file=sys.stderr, flush=True)
            for _ in range(warmup):
                step(fn, t)
            times = [_timed(fn, t, dev) for _ in range(iters)]
            peak = None
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            loss, dx, dw = step(fn, t)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            rows.append({"loss": kind, "provider": name, "ms": statistics.median(times), "ms_all": times,
                         "peak_extra_mib": peak, "loss_value": loss.item(), "rel_loss": rel(loss, ref_loss),
                         "rel_dx": rel(dx, ref_dx), "rel_dw": rel(dw, ref_dw)})
            del loss, dx, dw
            progress.advance(f"{kind} {name}")
        del t
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if json_path is not None and i < len(losses) - 1:  # after every loss: a run stopped part way keeps them
            try:
                write_atomic(json_path, json.dumps(label({"meta": _meta(settings, dev), "rows": rows}, dev.type),
                                                   indent=1))
            except OSError as exc:  # the run goes on; the last write keeps the results wherever it can
                if not warned:
                    print(f"[bench-losses] cannot write {json_path} ({exc.strerror or exc}); measuring on",
                          file=sys.stderr, flush=True)
                    warned = True
    result = label({"meta": _meta(settings, dev), "rows": rows}, dev.type)
    if json_path is not None:
        write_results(json_path, json.dumps(result, indent=1))
    return result


def format_table(result: dict) -> str:
    """The rows as a text table, each time also as a ratio to Liger-Kernel's for the same loss; a functional run's
    table opens with the line that says so."""
    by = {(r["loss"], r["provider"]): r for r in result["rows"]}
    lines = [f"{result['functional_run_reason']}:"] if result.get("functional_run_reason") else []
    lines += [f"{'loss':5s} {'provider':15s} {'fwd+bwd ms':>10s} {'peak extra MiB':>15s} {'vs liger':>9s} "
             f"{'rel loss':>9s} {'rel dx':>9s} {'rel dW':>9s}"]
    for r in result["rows"]:
        lk = by.get((r["loss"], "liger-kernel"))
        ratio = f"{r['ms'] / lk['ms']:.2f}x" if lk else "-"
        peak = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
        lines.append(f"{r['loss']:5s} {r['provider']:15s} {r['ms']:10.2f} {peak:>15s} {ratio:>9s} "
                     f"{r['rel_loss']:9.1e} {r['rel_dx']:9.1e} {r['rel_dw']:9.1e}")
    return "\n".join(lines)
