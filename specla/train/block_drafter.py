"""Training the parallel block drafters: DSpark, its fine-tuned control, and ReaDy (docs/ready.md).

    train_block_drafter(target_dir, out_dir, data, kind="dspark" | "dspark-ft" | "ready",
                        init_from=None, stage=1 | 2, ...)

- kind "dspark": the DSpark drafter from scratch (AdamW lr 1e-3, betas 0.9/0.95, wd 0.01).
- kind "ready", stage 1: a ReaDy drafter built from a trained DSpark export (`init_from`); only the
  new reader parameters train, the drafter is frozen (AdamW lr 1e-4, betas 0.9/0.999, eps 1e-8,
  wd 0 — ReaDy's Table 8). Stage 2: from the stage-1 export, the whole drafter (lr 5e-5).
- kind "dspark-ft": the control — the same DSpark export fine-tuned with the stage-2 settings and
  no state access, for as many steps as ReaDy's two stages together.

Data: the target's own greedy responses (`specla data responses` .npz, `ResponseSet`, the same
batches as the EAGLE trainer). Per batch one frozen-target forward (`Model.forward`, bf16 on
GPU, as when decoding) gives the captured features, the target's next-token distributions and
the residual stream entering each source layer. Anchors — roots r whose first predicted token
r + 1 is a response token — are drawn per sequence (`anchors` of them, seeded by (seed, step,
rank)); block (b, r) sees the context entries s < r and predicts tokens r + 1 .. r + P, every
anchor of every sequence in one drafter forward (`DSparkModel.block_hidden`).

Committed states at the anchors (ReaDy): the state after consuming tokens < r, which is what
the cache holds (after a flush) when r is the root. They are recomputed from the frozen target
without a forward per anchor: the source layer's q/k/v/g/β are recomputed from the captured
residual stream (its projections and short conv, as `Model.forward` does), one chunked UT-form
scan (DESIGN §2, chunks of 64 tokens, fp32) gives the state at every chunk start and every
token's corrected update u, and each anchor's state is its chunk's start state advanced by the
chunk's first tokens: S_r = Γ S_c + Σ_{j<r} (Γ/Γ_j) k_j u_jᵀ (a rank ≤ 64 update per anchor).
Equal to the decode-time committed state up to rounding (float64: 1e-10; tested).

Loss per draft position i (weights decay**i, normalised): cross-entropy to the target's greedy
token plus `tv_weight` × total variation to the target's distribution, both on the sequential
head's logits with the true previous token (teacher forcing is exact along an accepted prefix),
plus `conf_weight` × BCE of the confidence head (on detached features) against whether the
position's greedy draft is the target's token. Only positions that predict response tokens count.

Resumable like the other trainers: `ckpt.pt`, `export/`, the same command continues; torchrun
for several GPUs (DDP over the drafter).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from specla.drafters.blocks import CLASSES, load_block_drafter, save_block_drafter
from specla.drafters.dspark import DSparkConfig, DSparkModel
from specla.drafters.ready import ReadyModel
from specla.errors import InputError
from specla.model import GatedDeltaNet, Model
from specla.ops.conv import naive as conv_ref
from specla.ops.reader import naive as reader_ref
from specla.precision import accumulation_dtype
from specla.train.dist import wrap
from specla.train.drafter import ResponseBatches, ResponseSet, frozen_target
from specla.train.loop import TrainingRun, optimizer_step

KINDS = ("dspark", "dspark-ft", "ready")
# ReaDy Table 8: AdamW (0.9, 0.999), eps 1e-8, no weight decay; stage 1 lr 1e-4, stage 2 lr 5e-5
ADAPT = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
STAGE_LR = {1: 1e-4, 2: 5e-5}


# --------------------------------------------------------------------------- target side

@torch.no_grad()
def target_pass(target: Model, tokens: torch.Tensor, feature_layers, source_layers=()):
    """The frozen target's contribution to a batch, from one plain forward: (captured feature
    hidden states, embeddings, next-token log-probabilities fp32, residual stream entering
    each source layer {layer: [B, T, D]})."""
    inputs = {l - 1 for l in source_layers if l > 0}
    out = target(tokens, target.new_cache(tokens.shape[0], max_len=tokens.shape[1]),
                 capture=tuple(sorted(set(feature_layers) | inputs)))
    logp = torch.log_softmax(out.logits.to(accumulation_dtype(out.logits.dtype)), -1)
    emb = target.embeddings(tokens)
    src = {l: (out.hidden[l - 1] if l > 0 else emb) for l in source_layers}
    return [out.hidden[i] for i in feature_layers], emb, logp, src


@torch.no_grad()
def layer_factors(target: Model, layer: int, h_in: torch.Tensor):
    """k, v, g, beta of GDN layer `layer` for a whole sequence entering it (zero initial state),
    in the state's precision, as `Model.forward` computes them."""
    blk = target.layers[layer]
    mixer = blk.mixer
    if not isinstance(mixer, GatedDeltaNet):
        raise ValueError(f"target layer {layer} is not a GDN layer")
    x, _, a, b = mixer._project(blk.attn_norm(h_in))
    if mixer.cfg.use_short_conv:
        conv = torch.zeros(x.shape[0], mixer.cfg.conv_dim, mixer.cfg.conv_size - 1, device=x.device, dtype=x.dtype)
        xc = conv_ref.conv_sequence(x, conv, mixer.conv_weight, mixer.conv_bias)
    else:
        xc = F.silu(x)
    sdt = torch.float64 if target.dtype == torch.float64 else torch.float32
    _, k, v, g, beta = mixer._factors(xc, a, b, sdt)
    return k, v, g, beta


@torch.no_grad()
def states_at(k, v, g, beta, anchors: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """GDN states after consuming tokens < anchors[b, a] of each sequence: [B, A, HV, K, V].

    k [B, T, H, K] (l2-normalised), v [B, T, HV, V], g, beta [B, T, HV]. One chunked UT-form
    scan gives every chunk's start state and every token's corrected update u; an anchor's state
    is its chunk's start state advanced by the chunk's tokens before it.
    """
    B, T, HV, V = v.shape
    k = k.repeat_interleave(HV // k.shape[2], 2)
    K, dt, dev = k.shape[-1], v.dtype, v.device
    pad = (-T) % chunk
    if pad:  # padded tokens: k = v = g = beta = 0 change nothing
        k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
        g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
    N, C = (T + pad) // chunk, chunk
    k, v = (x.reshape(B, N, C, HV, -1).permute(0, 3, 1, 2, 4) for x in (k, v))  # [B, HV, N, C, .]
    g, beta = (x.reshape(B, N, C, HV).permute(0, 3, 1, 2) for x in (g, beta))
    gc = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    strict = lower & ~torch.eye(C, dtype=torch.bool, device=dev)
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=dt, device=dev).expand_as(A)
    Tm = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    Uv = Tm @ (beta[..., None] * v)
    W = Tm @ (beta[..., None] * gc.exp()[..., None] * k)
    kd = k * (gc[..., -1:] - gc).exp()[..., None]
    S = v.new_zeros(B, HV, K, V)
    starts, us = [], []
    for c in range(N):
        starts.append(S)
        u = Uv[:, :, c] - W[:, :, c] @ S
        us.append(u)
        S = gc[:, :, c, -1].exp()[..., None, None] * S + kd[:, :, c].transpose(-1, -2) @ u
    starts, us = torch.stack(starts, 2), torch.stack(us, 2)  # [B, HV, N, K, V], [B, HV, N, C, V]
    i = (anchors - 1).clamp(min=0)  # the last consumed token
    c, j = i // C, i % C
    rows = torch.arange(B, device=dev)[:, None]
    S0 = starts.permute(0, 2, 1, 3, 4)[rows, c]  # [B, A, HV, K, V]
    kc = k.permute(0, 2, 1, 3, 4)[rows, c]  # [B, A, HV, C, K]
    uc = us.permute(0, 2, 1, 3, 4)[rows, c]
    gcc = gc.permute(0, 2, 1, 3)[rows, c]  # [B, A, HV, C]
    gj = gcc.gather(-1, j[..., None, None].expand(-1, -1, HV, 1))  # log Γ at token i
    live = (torch.arange(C, device=dev) <= j[..., None])[:, :, None, :]  # [B, A, 1, C]
    w = (gj - gcc).masked_fill(~live, float("-inf")).exp()
    S_r = gj.exp()[..., None] * S0 + torch.einsum("bahc,bahck,bahcv->bahkv", w, kc, uc)
    return torch.where((anchors > 0)[..., None, None, None], S_r, torch.zeros_like(S_r))


def committed_states(target: Model, source_inputs: dict, anchors: torch.Tensor, chunk: int = 64) -> list:
    """Per source layer, the committed state at every anchor, flattened: [B * A, HV, K, V]."""
    out = []
    for layer, h in source_inputs.items():
        S = states_at(*layer_factors(target, layer, h), anchors, chunk)
        out.append(S.flatten(0, 1))
    return out


def pick_anchors(valid: torch.Tensor, count: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` anchors per sequence among roots r >= 1 whose next token is a response token
    (valid[b, r]): (anchors [B, count], live [B, count]), sorted; unused slots are dead."""
    B = valid.shape[0]
    anchors = np.zeros((B, count), dtype=np.int64)
    live = np.zeros((B, count), dtype=bool)
    for b in range(B):
        cand = np.flatnonzero(valid[b].numpy())
        cand = cand[cand >= 1]
        pick = np.sort(rng.choice(cand, size=min(count, len(cand)), replace=False)) if len(cand) else cand
        anchors[b, :len(pick)] = pick
        live[b, :len(pick)] = True
    return torch.from_numpy(anchors), torch.from_numpy(live)


def state_reader(states: list):
    """The `read` a ReaDy model's injection uses during training: the reference read of
    precomputed committed states (differentiable in the queries and the value map)."""
    def read(q, value_map):
        return reader_ref.state_read(states, [None] * len(states), q, value_map, flush=False)
    return read


# --------------------------------------------------------------------------- loss

class BlockLoss(nn.Module):
    """DDP wraps `forward`; the frozen target's outputs come in as plain tensors."""

    def __init__(self, drafter: DSparkModel, step_decay: float = 0.8, tv_weight: float = 1.0,
                 conf_weight: float = 0.1):
        super().__init__()
        self.drafter, self.step_decay, self.tv_weight, self.conf_weight = drafter, step_decay, tv_weight, conf_weight

    def forward(self, hidden, emb, logp, tokens, valid, anchors, live, lm_head_weight, states=None):
        """(loss, per-position stats [4, P]: top-1 hits, counts, conf BCE sum, survival of full blocks
        [P] as hits of the leading run), all detached except the loss."""
        m = self.drafter
        B, T = tokens.shape
        P = m.cfg.block_size
        rows = torch.arange(B, device=tokens.device)[:, None]
        read = state_reader(states) if states is not None else None
        h = m.block_hidden(m.features(hidden), emb[rows, anchors], anchors, read)  # [B, A, P, D]
        t = anchors[..., None] + torch.arange(P, device=tokens.device)  # label positions [B, A, P]
        ok = live[..., None] & valid[rows[..., None], t.clamp(max=T - 1)] & (t < T)
        tc = t.clamp(max=T - 1)
        prev = tokens[rows[..., None], tc]  # the token before each predicted one (the root first)
        logits = m.logits(h, lm_head_weight) + m.seq_bias(prev).to(h.dtype)
        logq = torch.log_softmax(logits.float(), -1)
        lp = logp[rows[..., None], tc].float()  # target [B, A, P, V]
        label = lp.argmax(-1)
        ce = -logq.gather(-1, label[..., None]).squeeze(-1)
        tv = 0.5 * (logq.exp() - lp.exp()).abs().sum(-1)
        hit = logq.argmax(-1) == label
        conf = m.confidence(h.detach(), logq.detach().max(-1).values).float()
        bce = F.binary_cross_entropy_with_logits(conf, hit.float(), reduction="none")
        w = ok.float()
        per_pos = ((ce + self.tv_weight * tv + self.conf_weight * bce) * w).sum((0, 1)) / w.sum((0, 1)).clamp(min=1)
        decay = self.step_decay ** torch.arange(P, device=tokens.device, dtype=per_pos.dtype)
        loss = (per_pos * decay).sum() / decay.sum()
        full = ok.all(-1)  # fully observable blocks
        run = (hit | ~ok).long().cumprod(-1).bool() & full[..., None]
        stats = torch.stack([(hit & ok).sum((0, 1)).float(), ok.sum((0, 1)).float(), (bce * w).sum((0, 1)),
                             run.sum((0, 1)).float(), full.sum().float().expand(P)]).detach()
        return loss, stats


def summarize(stats: torch.Tensor) -> dict:
    hits, counts, bce, run, full = stats.double().tolist()
    surv = [r / max(full[0], 1) for r in run]
    return {"top1": [round(h / max(c, 1), 4) for h, c in zip(hits, counts)],
            "survival": [round(s, 4) for s in surv], "accept_length": round(1 + sum(surv), 4),
            "conf_bce": round(sum(bce) / max(sum(counts), 1), 4), "full_blocks": int(full[0])}


def _batch(target, model, batches, step, anchors_per_seq, seed, rank, dev, chunk):
    tokens, valid = batches.get(step)
    anchors, live = pick_anchors(valid, anchors_per_seq, np.random.default_rng([seed, step, rank, 11]))
    tokens, valid, anchors, live = (x.to(dev, non_blocking=True) for x in (tokens, valid, anchors, live))
    src = model.cfg.source_layers if isinstance(model, ReadyModel) else []
    hidden, emb, logp, inputs = target_pass(target, tokens, model.cfg.feature_layers, src)
    states = committed_states(target, inputs, anchors, chunk) if src else None
    return hidden, emb, logp, tokens, valid, anchors, live, states


@torch.no_grad()
def evaluate(loss_fn: BlockLoss, target: Model, batches: ResponseBatches, n_batches: int, anchors_per_seq: int,
             seed: int, chunk: int = 64) -> dict:
    """Held-out loss, per-position top-1, draft-prefix survival over fully observable blocks and the
    accepted length a full block would reach (1 + Σ survival), confidence BCE."""
    m = loss_fn.drafter
    dev = target.device
    was = m.training
    m.eval()
    losses, total = [], None
    for i in range(n_batches):
        *args, states = _batch(target, m, batches, i, anchors_per_seq, seed, 99, dev, chunk)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss, stats = loss_fn(*args, target.lm_head.weight, states)
        losses.append(float(loss))
        total = stats if total is None else total + stats
    m.train(was)
    s = summarize(total)
    return {"val_loss": round(sum(losses) / len(losses), 4), "val_top1": s["top1"], "val_survival": s["survival"],
            "val_accept_length": s["accept_length"], "val_conf_bce": s["conf_bce"]}


# --------------------------------------------------------------------------- training

def _build(kind: str, stage: int, target: Model, init_from, ckpt, reader_options: dict, dspark_options: dict):
    """(model, config) for a new run or a resumed one."""
    if ckpt is not None:
        config_cls, model_cls = CLASSES[ckpt["model_type"]]
        model = model_cls(config_cls(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
        return model
    if kind == "dspark" and init_from is None:
        return DSparkModel(DSparkConfig.for_target(target.cfg, **dspark_options))
    if init_from is None:
        raise InputError(f"kind {kind!r} (stage {stage}) starts from a trained drafter: pass init_from")
    base = load_block_drafter(init_from, device="cpu", dtype=torch.float32)
    if kind == "ready" and not isinstance(base, ReadyModel):
        if stage != 1:
            raise InputError("ReaDy stage 2 starts from a stage-1 ReaDy export, not a DSpark one")
        base = ReadyModel.from_dspark(base, target.cfg, **reader_options)
    if kind in ("dspark", "dspark-ft") and isinstance(base, ReadyModel):
        raise InputError(f"kind {kind!r} starts from a DSpark export, got a ReaDy one")
    return base


def train_block_drafter(target_dir, out_dir, data, kind: str = "dspark", init_from=None, stage: int = 1,
                        total_steps: int | None = None, total_minutes: float = 8.0, max_minutes: float = 8.0,
                        batch_size: int = 32, seq_len: int = 768, anchors: int = 16, lr: float | None = None,
                        warmup: int | None = None, step_decay: float = 0.8, tv_weight: float = 1.0,
                        conf_weight: float = 0.1, feature_layers: list[int] | None = None,
                        num_layers: int | None = None, block_size: int | None = None,
                        source_layers: list[int] | None = None, reader_rank: int | str | None = None,
                        inject_layers: list[int] | None = None, inject_site: str | None = None,
                        val_fraction: float = 0.02, eval_every: int = 250, eval_batches: int = 8,
                        log_every: int = 10, checkpoint_minutes: float = 2.0, chunk: int = 64, seed: int = 0,
                        device: str = "auto", progress: bool = True) -> dict:
    """Train a block drafter of the target in target_dir on a `collect_responses` dataset.

    kind "dspark" trains from scratch (or continues an export of a dspark run); "ready" and
    "dspark-ft" adapt a trained drafter (`init_from`): ReaDy stage 1 trains only the reader,
    stage 2 (and dspark-ft) the whole drafter. lr/warmup default per kind and stage. The reader
    options (source_layers, reader_rank ("full" or None: no bottleneck), inject_layers,
    inject_site) apply when a ReaDy drafter is built from a DSpark one. Re-run to resume.
    """
    if kind not in KINDS:
        raise InputError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if stage not in (1, 2):
        raise InputError(f"stage must be 1 or 2, got {stage}")
    scratch = kind == "dspark"
    stage = 0 if scratch else 2 if kind == "dspark-ft" else stage  # 0: not an adaptation stage
    dataset = ResponseSet(data)  # read first: a bad path fails before the target loads
    run = TrainingRun(out_dir, device)
    dev = run.dev
    target = frozen_target(target_dir, dev)

    ckpt = run.load()
    counters = {"step": 0, "train_seconds": 0.0, "sequences_seen": 0, "total_steps": None}
    if ckpt is not None:
        if (ckpt["kind"], ckpt["stage"]) != (kind, stage):
            raise InputError(f"{run.out} holds a {ckpt['kind']} stage-{ckpt['stage']} run; asked for {kind} stage {stage}")
    elif init_from is not None:
        state = json.loads((Path(init_from) / "training_state.json").read_text()) \
            if (Path(init_from) / "training_state.json").is_file() else {}
        if (state.get("kind"), state.get("stage")) == (kind, stage):  # an export of this very run
            counters = {k: state.get(k, v) for k, v in counters.items()}
    reader_options = {k: v for k, v in dict(source_layers=source_layers, reader_rank=reader_rank,
                                            inject_layers=inject_layers, inject_site=inject_site).items()
                      if v is not None}
    if reader_options.get("reader_rank") == "full":
        reader_options["reader_rank"] = None
    dspark_options = {k: v for k, v in dict(feature_layers=feature_layers, num_layers=num_layers,
                                            block_size=block_size).items() if v is not None}
    torch.manual_seed(seed)
    model = _build(kind, stage, target, init_from, ckpt, reader_options, dspark_options)
    model.cfg.check(target.cfg)
    model = model.to(device=dev, dtype=torch.float32)
    if kind == "ready" and stage == 1:
        train_params = model.reader_parameters()
        model.requires_grad_(False)
        for p in train_params:
            p.requires_grad_(True)
    else:
        train_params = list(model.parameters())
        model.requires_grad_(True)
    if scratch:
        lr = lr or 1e-3
        warmup = 100 if warmup is None else warmup
        decay_p = [p for p in train_params if p.dim() >= 2]
        no_decay = [p for p in train_params if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay_p, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    else:
        lr = lr or STAGE_LR[stage]
        warmup = 20 if warmup is None else warmup
        opt = torch.optim.AdamW(train_params, lr=lr, fused=dev.type == "cuda", **ADAPT)
    if ckpt is not None:
        opt.load_state_dict(ckpt["optimizer"])
        counters = {k: ckpt[k] for k in counters}
    step, train_seconds, seqs_seen = counters["step"], counters["train_seconds"], counters["sequences_seen"]
    total_steps = total_steps or counters["total_steps"]
    loss_fn = BlockLoss(model, step_decay, tv_weight, conf_weight)
    net = wrap(loss_fn, dev, run.distributed)

    train_idx, val_idx = dataset.split(val_fraction, seed)
    train = ResponseBatches(dataset, train_idx, batch_size, seq_len, seed, run.rank)
    val = ResponseBatches(dataset, val_idx, batch_size, seq_len)
    eval_batches = min(eval_batches, len(val))
    run.header(ckpt is not None, kind=kind, stage=stage, model_type=model.model_type,
               config=dataclasses.asdict(model.cfg), target=str(target_dir), init_from=str(init_from),
               params=sum(p.numel() for p in model.parameters()), trainable=sum(p.numel() for p in train_params),
               data=str(data), train_sequences=len(train_idx), val_sequences=len(val_idx),
               batch_size=batch_size * run.world, seq_len=seq_len, anchors=anchors, lr=lr)

    def save(step: int, train_seconds: float) -> None:
        run.save({"kind": kind, "stage": stage, "model_type": model.model_type, "config": dataclasses.asdict(model.cfg),
                  "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                  "train_seconds": train_seconds, "sequences_seen": seqs_seen, "total_steps": run.clock.total_steps})

    def train_step(step: int):
        nonlocal seqs_seen
        clock = run.clock
        with clock.phase("batch and target"):
            *args, states = _batch(target, model, train, step, anchors, seed, run.rank, dev, chunk)
        cur_lr = clock.lr(step, lr, warmup)
        with clock.phase("update"):
            (loss, stats), gnorm = optimizer_step(opt, train_params, cur_lr, dev,
                                                  lambda: net(*args, target.lm_head.weight, states))
        seqs_seen += batch_size * run.world
        return loss, stats, gnorm, cur_lr

    def after_step(step: int, train_seconds: float, result) -> None:
        loss, stats, gnorm, cur_lr = result
        if run.main and step % log_every == 0:
            s = summarize(stats)
            run.bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{s['top1'][0]:.3f}", tau=f"{s['accept_length']:.2f}")
            run.record({"step": step, "loss": round(loss.item(), 4), "top1": s["top1"],
                        "accept_length": s["accept_length"], "lr": cur_lr, "grad_norm": round(float(gnorm), 3),
                        "sequences": seqs_seen, "train_seconds": round(train_seconds, 1)})

    model.train()
    desc = f"train {kind}" + ("" if scratch else f" stage {stage}")
    step, train_seconds = run.steps(total_steps, total_minutes, max_minutes, checkpoint_minutes, step, train_seconds,
                                    train_step, after_step, save, desc, progress,
                                    validate=lambda: evaluate(loss_fn, target, val, eval_batches, anchors, seed, chunk),
                                    eval_every=eval_every)
    save(step, train_seconds)
    metrics = run.metrics

    def export() -> None:
        out = save_block_drafter(model, run.out / "export", dtype=torch.bfloat16)
        (out / "training_state.json").write_text(json.dumps(
            {"kind": kind, "stage": stage, "model_type": model.model_type, "config": dataclasses.asdict(model.cfg),
             "step": step, "train_seconds": train_seconds, "sequences_seen": seqs_seen,
             "total_steps": run.clock.total_steps, "target": str(target_dir),
             "init_from": str(init_from) if init_from else None, **metrics}) + "\n")

    return run.close(step, train_seconds, export, kind=kind, stage=stage, sequences_seen=seqs_seen, **metrics)
