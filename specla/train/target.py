"""Pretraining of a pure-GDN target (`specla train target`).

Resumable: a run trains for at most `max_minutes`, then writes `ckpt.pt` (weights, optimiser,
step, schedule) and exits; the same command continues from it (`specla.train.loop` holds the
schedule and the clock). Several GPUs: the same command under torchrun (DDP).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla.config import ModelConfig
from specla.model import Model
from specla.train.dist import wrap
from specla.train.loop import TrainingRun, optimizer_step

def demo_config(tokenizer) -> ModelConfig:
    """The shipped demo target: depth over width within the 28 MB budget (DESIGN §9)."""
    vocab = 64 * math.ceil(tokenizer.vocab_size / 64)
    return ModelConfig(
        vocab_size=vocab, hidden_size=256, num_hidden_layers=12, intermediate_size=768,
        num_heads=4, num_v_heads=4, head_dim=64, head_v_dim=64, tie_word_embeddings=True,
        max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=sorted(tokenizer.eos_token_ids), pad_token_id=tokenizer.pad_token_id)


class _LossModule(nn.Module):
    """DDP wraps `forward`; the model's training entry point is `train_logits`."""

    def __init__(self, model: Model):
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model.train_logits(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def _init_weights(model: Model, seed: int) -> None:
    from specla.shapes import random_model

    ref = random_model(model.cfg, device="cpu", dtype=torch.float32, seed=seed)
    with torch.no_grad():
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            p.copy_(r * (0.5 if p.dim() >= 2 and "embeddings" not in name else 1.0))


def _param_groups(model: Model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embeddings" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_target(out_dir, corpus_dir, tokenizer_dir, config: ModelConfig | None = None, total_steps: int | None = None,
                 total_minutes: float = 16.0, max_minutes: float = 8.0, batch_size: int = 64, seq_len: int = 1024,
                 lr: float = 2e-3, warmup: int = 200, weight_decay: float = 0.1, eval_every: int = 250,
                 eval_batches: int = 8, log_every: int = 10, checkpoint_minutes: float = 2.0, seed: int = 0, device: str = "auto",
                 init_from: Path | None = None, progress: bool = True) -> dict:
    from specla.checkpoint import save_model
    from specla.data.tokenizer import load_tokenizer
    from specla.train.data import Batches, tokenize_split

    run = TrainingRun(out_dir, device)
    dev, out = run.dev, run.out
    tok = load_tokenizer(tokenizer_dir)

    ckpt = run.load()
    resumed = ckpt is not None
    if ckpt is None and init_from is not None:
        # Continue from an exported run (weights and counters; the optimiser starts afresh),
        # for when the machine that held ckpt.pt is gone.
        from specla.checkpoint import load_model

        state = json.loads((Path(init_from) / "training_state.json").read_text())
        ckpt = {"model": load_model(init_from, dtype=torch.float32).state_dict(), "optimizer": None, **state}
    if ckpt is not None:
        cfg = ModelConfig(**ckpt["config"])
    else:
        cfg = config or demo_config(tok)
    model = Model(cfg).to(dev)
    if ckpt is None:
        _init_weights(model, seed)
    else:
        model.load_state_dict(ckpt["model"])
    opt = torch.optim.AdamW(_param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda")
    step, train_seconds, tokens_seen = 0, 0.0, 0
    if ckpt is not None:
        if ckpt["optimizer"] is not None:
            opt.load_state_dict(ckpt["optimizer"])
        step, train_seconds, tokens_seen = ckpt["step"], ckpt["train_seconds"], ckpt["tokens_seen"]
        total_steps = total_steps or ckpt.get("total_steps")
    net = wrap(_LossModule(model), dev, run.distributed)

    corpus_dir = Path(corpus_dir)
    splits = [(split, out / f"tokens_{split}.npy") for split in ("train", "val")]
    if run.main:  # rank 0 tokenises once; the other ranks read its cache
        for split, cache in splits:
            tokenize_split(corpus_dir, split, tok, cache, progress)
    if run.distributed:
        torch.distributed.barrier()
    train_tokens, val_tokens = (tokenize_split(corpus_dir, split, tok, cache, False) for split, cache in splits)
    train = Batches(train_tokens, batch_size, seq_len, seed, run.rank, run.world)
    val = Batches(val_tokens, batch_size, seq_len, seed + 1)
    run.header(resumed or init_from is not None, config=dataclasses.asdict(cfg),
               params=sum(p.numel() for p in model.parameters()), train_tokens=int(len(train_tokens)),
               val_tokens=int(len(val_tokens)), batch_size=batch_size * run.world, seq_len=seq_len, lr=lr)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = []
        for i in range(eval_batches):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                losses.append(_LossModule(model)(val.get(i).to(dev)).item())
        model.train()
        return sum(losses) / len(losses)

    def save(step: int, train_seconds: float) -> None:
        run.save({"config": dataclasses.asdict(cfg), "model": model.state_dict(), "optimizer": opt.state_dict(),
                  "step": step, "train_seconds": train_seconds, "tokens_seen": tokens_seen,
                  "total_steps": run.clock.total_steps})

    def train_step(step: int):
        nonlocal tokens_seen
        clock = run.clock
        with clock.phase("batch"):
            batch = train.get(step).to(dev, non_blocking=True)
        cur_lr = clock.lr(step, lr, warmup)
        with clock.phase("update"):
            loss, gnorm = optimizer_step(opt, model.parameters(), cur_lr, dev, lambda: net(batch))
        tokens_seen += batch_size * seq_len * run.world
        return loss, gnorm, cur_lr

    def after_step(step: int, train_seconds: float, result) -> None:
        loss, gnorm, cur_lr = result
        if run.main and step % log_every == 0:
            run.bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{cur_lr:.2e}")
            run.record({"step": step, "loss": round(loss.item(), 4), "lr": cur_lr, "grad_norm": round(float(gnorm), 3),
                        "tokens": tokens_seen, "train_seconds": round(train_seconds, 1)})
        if step % eval_every == 0 or run.clock.finished(step):
            vl = evaluate()
            run.record({"step": step, "val_loss": round(vl, 4), "tokens": tokens_seen,
                        "train_seconds": round(train_seconds, 1)}, flush=True)

    model.train()
    step, train_seconds = run.steps(total_steps, total_minutes, max_minutes, checkpoint_minutes, step, train_seconds,
                                    train_step, after_step, save, "train", progress)
    save(step, train_seconds)

    def export() -> None:
        d = out / "export"
        save_model(model, d, dtype=torch.bfloat16)
        (d / "training_state.json").write_text(json.dumps(
            {"config": dataclasses.asdict(cfg), "step": step, "train_seconds": train_seconds,
             "tokens_seen": tokens_seen, "total_steps": run.clock.total_steps}) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tokenizer_dir) / f).is_file():
                shutil.copy(Path(tokenizer_dir) / f, d / f)

    return run.close(step, train_seconds, export, tokens_seen=tokens_seen)
