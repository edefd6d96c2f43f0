"""The EAGLE drafter's data and training (`specla data responses`, `specla train drafter`).

Data. The drafter imitates the target, so it learns from the target's own greedy responses
to real prompts: the opening turns of ShareGPT conversations from the corpus and GSM8K
training questions, rendered with the target's chat template and generated with specla's
decode path (`Decoder`, AR route, batched). The dataset file (.npz) holds token ids only —
prompt + response per sequence, and where the response starts. Target features are
recomputed on the fly during training by running the frozen target over each batch (one
forward, the same `Model.forward` that prefill uses): storing three feature layers would
cost 1.5 KB per token at the demo shape, gigabytes for a dataset that is a few MB as ids.

Training. The drafter's unroll (`EagleDrafterModel.unroll`, EAGLE-3's training-time test)
runs `unroll` steps; step k at anchor t predicts token t + k + 2 and is scored against the
target's own distribution there (soft labels: cross-entropy to the target's softmax, so the
drafter's scores — the tree's pruning signal — track the target's probabilities). Only
positions that predict response tokens count. Step k's loss is weighted step_decay**k.
Validation reports per-step top-1 agreement with the target's greedy token and the accepted
length a chain of `unroll` drafts would reach on held-out sequences (1 + the leading run of
agreements, EAGLE's τ).

Resumable like the target trainer: a run trains for at most `max_minutes`, then writes
`ckpt.pt` and `export/` (drafter safetensors + config + training_state.json); the same
command continues. Several GPUs: the same command under torchrun (DDP, one process a GPU).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from specla.drafters.eagle import EagleConfig, EagleDrafterModel, load_drafter, save_drafter
from specla.errors import InputError
from specla.model import Model
from specla.precision import accumulation_dtype
from specla.train.dist import wrap
from specla.train.loop import TrainingRun, optimizer_step


# --------------------------------------------------------------------------- prompts

_CHUNK = re.compile(r"(?:_(\d+))?$")
_TURN = re.compile(r"<\|(system|user|assistant)\|>\n(.*?)(?=<\|(?:system|user|assistant|eos)\|>|\Z)", re.S)


def frozen_target(target_dir, dev: torch.device) -> Model:
    """The target a drafter trains against, frozen and run as decoding runs it: bf16 on a GPU
    (fp32 on a CPU)."""
    from specla.checkpoint import load_model

    target = load_model(target_dir, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return target.requires_grad_(False)


def opening_turns(text: str) -> list[dict]:
    """The turns of a rendered corpus conversation before its first assistant reply."""
    turns = []
    for role, content in _TURN.findall(text):
        if role == "assistant":
            break
        turns.append({"role": role, "content": content[:-1] if content.endswith("\n") else content})
    return turns if any(t["role"] == "user" for t in turns) else []


# the shipped drafter's data: every ShareGPT opener of the reference corpus but 26, and 7,373
# of GSM8K's 7,473 training questions
N_PROMPTS = 16384
GSM8K_SHARE = 0.45


def _gsm8k_split(n_questions: int, n_gsm: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(picked, left out) GSM8K training-question indices: the first draw of `training_prompts`'
    generator, so `held_out_gsm8k` names exactly the questions a collection did not use."""
    order = rng.permutation(n_questions)
    return order[:n_gsm], order[n_gsm:]


def held_out_gsm8k(n_prompts: int = N_PROMPTS, gsm8k_share: float = GSM8K_SHARE, seed: int = 0) -> list[int]:
    """Indices (ascending) of the GSM8K training questions `training_prompts` leaves out: held-out
    prompts for measuring a drafter trained on that data."""
    from specla.data.suites import load_gsm8k_train

    _, left = _gsm8k_split(len(load_gsm8k_train()), round(n_prompts * gsm8k_share), np.random.default_rng(seed))
    return sorted(left.tolist())


def training_prompts(corpus_dir, n_prompts: int, gsm8k_share: float = GSM8K_SHARE,
                     seed: int = 0) -> list[tuple[str, list[dict]]]:
    """(source, turns) for n_prompts prompts: the opening turns of ShareGPT conversations from
    the corpus training split and GSM8K training questions, a seeded sample of each, shuffled
    together. Only a conversation's first chunk (id suffix _0) counts: later chunks open
    mid-conversation, often with a bare "continue"."""
    from specla.data.corpus import iter_records
    from specla.data.suites import load_gsm8k_train

    rng = np.random.default_rng(seed)
    gsm = load_gsm8k_train()
    gsm_idx, _ = _gsm8k_split(len(gsm), round(n_prompts * gsm8k_share), rng)
    picked = [("gsm8k", [{"role": "user", "content": gsm[i]["question"]}]) for i in gsm_idx]
    chats = [t for r in iter_records(corpus_dir, "train")
             if r["source"] == "sharegpt" and _CHUNK.search(r["id"]).group(1) in (None, "0")
             for t in [opening_turns(r["text"])] if t]
    picked += [("sharegpt", chats[i]) for i in rng.permutation(len(chats))[:n_prompts - len(picked)]]
    return [picked[i] for i in rng.permutation(len(picked))]


def prompt_corpus(corpus_dir, out_dir) -> dict:
    """A prompts-only copy of a corpus: the records `training_prompts` reads (ShareGPT first
    chunks with an opening), each cut to its opening turns, in the same order, so both pick the
    same prompts. 1.6 MB instead of 23 MB for the reference corpus: what travels to a GPU
    machine to collect responses."""
    import lzma

    from specla.data.corpus import iter_records
    from specla.data.chat import render_chat

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = 0
    with lzma.open(out / "train.jsonl.xz", "wt", encoding="utf-8", preset=9) as f:
        for r in iter_records(corpus_dir, "train"):
            if r["source"] == "sharegpt" and _CHUNK.search(r["id"]).group(1) in (None, "0"):
                turns = opening_turns(r["text"])
                if turns:
                    f.write(json.dumps({"source": r["source"], "id": r["id"], "text": render_chat(turns)}) + "\n")
                    kept += 1
    return {"out": str(out), "records": kept, "bytes": (out / "train.jsonl.xz").stat().st_size}


def chat_header(tokenizer) -> int:
    """Tokens every chat prompt starts with (BOS, the first role marker): kept when cutting."""
    a = tokenizer.apply_chat_template([{"role": "user", "content": "a"}])
    b = tokenizer.apply_chat_template([{"role": "user", "content": "b"}])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cut(ids: list[int], length: int, header: int) -> list[int]:
    """ids shortened to `length` by dropping the oldest tokens after the header."""
    if len(ids) <= length:
        return ids
    keep = min(header, length - 1)
    return ids[:keep] + ids[len(ids) - (length - keep):]


# --------------------------------------------------------------------------- responses

def length_batches(lengths: list[int], batch_size: int, max_cut: int) -> list[list[int]]:
    """Prompt indices grouped for equal-length batches: sorted by length, a batch holds at most
    batch_size prompts no longer than its shortest + max_cut."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and lengths[i] - lengths[batches[-1][0]] <= max_cut:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def generate_responses(model: Model, prompts: list[list[int]], max_new_tokens: int, eos_token_ids,
                       batch_size: int = 64, max_cut: int = 8, header: int = 0, max_minutes: float | None = None,
                       graphs: bool = False, seed: int = 0,
                       progress: bool = True) -> list[tuple[int, list[int], list[int]]]:
    """Greedy responses, batched: (prompt index, prompt as generated from, response).

    `Decoder.run` takes equal-length prompts, so each batch (`length_batches`) is cut to its
    shortest member (`cut`: at most max_cut of the oldest tokens after the header go).
    Batches run in a seeded random order and no new one starts after max_minutes, so a
    time-bounded collection is still a fair sample of prompt lengths.
    """
    from tqdm import tqdm

    from specla.decode import Decoder

    decoder = Decoder(model, eos_token_ids=eos_token_ids, graphs=graphs)
    out = []
    start = time.time()
    bar = tqdm(total=len(prompts), desc="responses", unit="prompt", disable=not progress)
    batches = length_batches([len(p) for p in prompts], batch_size, max_cut)
    for b in np.random.default_rng(seed).permutation(len(batches)):
        idx = batches[b]
        if max_minutes is not None and time.time() - start > max_minutes * 60:
            break
        rows = [cut(prompts[i], len(prompts[idx[0]]), header) for i in idx]
        emitted, _, _ = decoder.run(torch.tensor(rows), max_new_tokens)
        out += [(i, p, r) for i, p, r in zip(idx, rows, emitted)]
        bar.update(len(idx))
    bar.close()
    return out


def save_responses(path, prompts: list[list[int]], responses: list[list[int]], sources: list[str], meta: dict) -> Path:
    """One .npz: flat token ids, sequence offsets, prompt lengths, sources, metadata (JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seqs = [np.asarray(p + r, dtype=np.int64) for p, r in zip(prompts, responses)]
    flat = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int64)
    tokens = flat.astype(np.uint16 if flat.size == 0 or flat.max() < 2 ** 16 else np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, tokens=tokens, offsets=offsets, prompt_len=np.array([len(p) for p in prompts], np.int64),
                            source=np.array(sources, dtype=str), meta=np.array(json.dumps(meta)))
    tmp.replace(path)
    return path


def merge_responses(out_file, inputs) -> dict:
    """Join response files (e.g. the shards of one collection) into one; metadata keeps each
    input's."""
    sets = [ResponseSet(p) for p in inputs]
    if not sets:
        raise ValueError("no response files to merge")
    prompts, responses, sources = [], [], []
    for rs in sets:
        for i in range(len(rs)):
            seq, n = rs.sequence(i).tolist(), int(rs.prompt_len[i])
            prompts.append(seq[:n])
            responses.append(seq[n:])
            sources.append(str(rs.source[i]))
    meta = {**sets[0].meta, "merged": [rs.meta for rs in sets]}
    save_responses(out_file, prompts, responses, sources, meta)
    return {"file": str(out_file), "sequences": len(prompts), "response_tokens": sum(map(len, responses))}


class ResponseSet:
    """A dataset written by `save_responses`."""

    FIELDS = ("tokens", "offsets", "prompt_len", "source", "meta")

    def __init__(self, path):
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {f: z[f] for f in self.FIELDS if f in z.files}
        except FileNotFoundError:
            raise InputError(f"{path} not found: make the training data with `specla data responses`") from None
        except (OSError, ValueError):
            raise InputError(f"{path} is not an .npz file (`specla data responses` writes one)") from None
        missing = [f for f in self.FIELDS if f not in arrays]
        if missing:
            raise InputError(f"{path} has no {', '.join(missing)}: not a responses file of `specla data responses`")
        self.tokens, self.offsets, self.prompt_len = arrays["tokens"], arrays["offsets"], arrays["prompt_len"]
        self.source = arrays["source"]
        self.meta = json.loads(str(arrays["meta"]))

    def __len__(self) -> int:
        return len(self.prompt_len)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]].astype(np.int64)

    def split(self, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Seeded train / validation indices (at least one validation sequence)."""
        perm = np.random.default_rng([seed, 7]).permutation(len(self))
        n_val = max(1, round(len(self) * val_fraction))
        return np.sort(perm[n_val:]), np.sort(perm[:n_val])


# A batch's width is rounded up to a multiple of this. Triton specialises a kernel's integer
# arguments on their divisibility by 16, so batches whose lengths fell on both sides of it
# compiled every kernel of the frozen target's forward twice, the second time inside the run
# (44 of the 45 s of a DSpark run's second step on the H200, blocks_train_aa91f03.json).
WIDTH_MULTIPLE = 16


class ResponseBatches:
    """Batches of whole sequences, right-padded to a multiple of `WIDTH_MULTIPLE`: (tokens
    [B, T], valid [B, T]).

    valid[b, j]: position j's target distribution is a label, i.e. it predicts a response
    token (prompt_len - 1 <= j <= len - 2). Random batches (seed given) depend only on
    (seed, i, rank), so a resumed run continues the same sequence of batches and every rank
    draws its own; without a seed, batch i is the i-th run of consecutive sequences (validation).
    """

    def __init__(self, data: ResponseSet, index: np.ndarray, batch_size: int, seq_len: int,
                 seed: int | None = None, rank: int = 0):
        if len(index) == 0:
            raise ValueError("no sequences to draw batches from")
        self.data, self.index, self.bs, self.T, self.seed, self.rank = data, index, batch_size, seq_len, seed, rank

    def __len__(self) -> int:
        """Batches that cover every sequence once."""
        return -(-len(self.index) // self.bs)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.seed is None:
            picks = self.index[(step * self.bs + np.arange(self.bs)) % len(self.index)]
        else:
            rng = np.random.default_rng([self.seed, step, self.rank])
            picks = self.index[rng.integers(0, len(self.index), size=self.bs)]
        seqs = [self.data.sequence(i)[:self.T] for i in picks]
        T = -(-max(len(s) for s in seqs) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        tokens = np.zeros((self.bs, T), dtype=np.int64)
        valid = np.zeros((self.bs, T), dtype=bool)
        for b, (i, s) in enumerate(zip(picks, seqs)):
            tokens[b, :len(s)] = s
            valid[b, max(int(self.data.prompt_len[i]) - 1, 0):len(s) - 1] = True
        return torch.from_numpy(tokens), torch.from_numpy(valid)


def collect_responses(target_dir, out_file, n_prompts: int = N_PROMPTS, max_new_tokens: int = 256,
                      corpus_dir=".corpus", gsm8k_share: float = GSM8K_SHARE, max_prompt_tokens: int = 384,
                      batch_size: int = 512, max_cut: int = 16, seed: int = 0, device: str = "auto", dtype: str = "auto",
                      max_minutes: float | None = None, graphs: bool = False, shard: tuple[int, int] = (0, 1),
                      progress: bool = True) -> dict:
    """Generate the target's greedy responses to training prompts; write them to out_file (.npz).

    shard (k, n): only every n-th prompt from the k-th, so n processes (on one GPU or several)
    share the work; `merge_responses` joins their files.

    Decoding is launch-bound at these sizes, so a batch of 128 costs about what one row does
    per step. graphs: CUDA graphs for the AR steps (several times faster on a GPU than eager).
    """
    from specla.api import resolve_device, resolve_dtype
    from specla.checkpoint import load_model
    from specla.data.tokenizer import load_tokenizer

    t0 = time.time()
    dev = resolve_device(device)
    model = load_model(target_dir, device=dev, dtype=resolve_dtype(dtype, dev))
    tok = load_tokenizer(target_dir)
    header = chat_header(tok)
    k, n = shard
    if not 0 <= k < n:
        raise InputError(f"--shard {k}/{n}: need 0 <= K < N")
    picked = training_prompts(corpus_dir, n_prompts, gsm8k_share, seed)[k::n]
    prompts = [cut(tok.apply_chat_template(turns), max_prompt_tokens, header) for _, turns in picked]
    eos = tok.eos_token_ids | set(model.cfg.eos_token_id)
    done = generate_responses(model, prompts, max_new_tokens, eos, batch_size=batch_size, max_cut=max_cut, header=header,
                              max_minutes=max_minutes, graphs=graphs, seed=seed, progress=progress)
    meta = {"target": str(target_dir), "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
            "dtype": str(model.dtype), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "seed": seed, "shard": [k, n], "seconds": round(time.time() - t0, 1)}
    save_responses(out_file, [p for _, p, _ in done], [r for _, _, r in done], [picked[i][0] for i, _, _ in done], meta)
    n_resp = sum(len(r) for _, _, r in done)
    return {"file": str(out_file), "sequences": len(done), "prompts_asked": len(prompts),
            "response_tokens": n_resp, "prompt_tokens": sum(len(p) for _, p, _ in done),
            "ended_with_eos": sum(1 for _, _, r in done if r and r[-1] in eos), **meta}


# --------------------------------------------------------------------------- training

@torch.no_grad()
def target_side(target: Model, tokens: torch.Tensor, layers) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """What the frozen target contributes to a batch: the captured hidden states, the token
    embeddings and its next-token log-probabilities (fp32), from one plain forward."""
    out = target(tokens, target.new_cache(tokens.shape[0], max_len=tokens.shape[1]), capture=tuple(layers))
    logp = torch.log_softmax(out.logits.to(accumulation_dtype(out.logits.dtype)), -1)
    return [out.hidden[i] for i in layers], target.embeddings(tokens), logp


def _steps(drafter: EagleDrafterModel, hidden, emb, target_logp, valid, lm_head_weight, unroll: int):
    """Per unroll step k: anchors (b, t) whose label position t + k + 1 is valid, the drafter's
    log-probabilities there and the target's."""
    hs = drafter.unroll(drafter.features(hidden), emb, unroll)
    for k, h in enumerate(hs):
        b, t = valid[:, k + 1:].nonzero(as_tuple=True)
        logq = torch.log_softmax(drafter.logits(h[b, t], lm_head_weight).float(), -1)
        yield k, b, t, logq, target_logp[b, t + k + 1]


def _soft_ce(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the drafter's log-probabilities to the target's distribution."""
    return -(logp.exp() * logq).sum(-1).sum() / max(len(logq), 1)


class _TTTLoss(nn.Module):
    """DDP wraps `forward`; the frozen target's outputs come in as plain tensors."""

    def __init__(self, drafter: EagleDrafterModel, unroll: int, step_decay: float):
        super().__init__()
        self.drafter, self.unroll, self.step_decay = drafter, unroll, step_decay

    def forward(self, hidden, emb, target_logp, valid, lm_head_weight):
        """(weighted loss over the unroll, top-1 agreement per step)."""
        total, top1 = 0.0, []
        for k, _, _, logq, logp in _steps(self.drafter, hidden, emb, target_logp, valid, lm_head_weight, self.unroll):
            total = total + self.step_decay ** k * _soft_ce(logq, logp)
            hit = (logq.argmax(-1) == logp.argmax(-1)).float()
            top1.append(hit.mean() if len(hit) else hit.new_zeros(()))
        return total / sum(self.step_decay ** k for k in range(self.unroll)), torch.stack(top1).detach()


@torch.no_grad()
def evaluate(drafter: EagleDrafterModel, target: Model, batches: ResponseBatches, n_batches: int, unroll: int,
             step_decay: float) -> dict:
    """Held-out loss, per-step top-1 agreement, and the accepted length of an `unroll`-token
    chain (1 + the leading run of agreements per anchor, averaged over anchors)."""
    dev = target.device
    W = target.lm_head.weight
    norm = sum(step_decay ** k for k in range(unroll))
    losses, hits, counts, runs, anchors = [], [0] * unroll, [0] * unroll, 0, 0
    was_training = drafter.training
    drafter.eval()
    for i in range(n_batches):
        tokens, valid = (t.to(dev) for t in batches.get(i))
        hidden, emb, logp = target_side(target, tokens, drafter.cfg.feature_layers)
        agree = torch.zeros(unroll, *valid.shape, dtype=torch.bool, device=dev)  # [k, b, t]
        loss = 0.0
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            for k, b, t, logq, lp in _steps(drafter, hidden, emb, logp, valid, W, unroll):
                loss += step_decay ** k * float(_soft_ce(logq, lp))
                hit = logq.argmax(-1) == lp.argmax(-1)
                agree[k, b, t] = hit
                hits[k] += int(hit.sum())
                counts[k] += len(hit)
        losses.append(loss / norm)
        first = valid[:, 1:]  # anchors whose first draft predicts a response token
        runs += int(agree.long().cumprod(0).sum(0)[:, :-1][first].sum())
        anchors += int(first.sum())
    drafter.train(was_training)
    return {"val_loss": round(sum(losses) / len(losses), 4),
            "val_top1": [round(h / max(c, 1), 4) for h, c in zip(hits, counts)],
            "val_accept_length": round(1 + runs / max(anchors, 1), 4)}


def train_drafter(target_dir, out_dir, data, total_steps: int | None = None, total_minutes: float = 8.0,
                  max_minutes: float = 8.0, batch_size: int = 32, seq_len: int = 768, lr: float = 1e-3,
                  warmup: int = 100, weight_decay: float = 0.01, unroll: int = 8, step_decay: float = 0.8,
                  feature_layers: list[int] | None = None, val_fraction: float = 0.02, eval_every: int = 250,
                  eval_batches: int = 8, log_every: int = 10, checkpoint_minutes: float = 2.0, seed: int = 0,
                  device: str = "auto", init_from=None, progress: bool = True) -> dict:
    """Train the EAGLE drafter of the target in target_dir on a `collect_responses` dataset.

    The schedule (warmup, cosine to 10%) spans total_steps, or, if not given, is fixed after a
    short calibration to fit total_minutes of training. Re-run the same command to resume.
    """
    dataset = ResponseSet(data)  # read first: a bad path fails before the target loads
    run = TrainingRun(out_dir, device)
    dev = run.dev
    target = frozen_target(target_dir, dev)

    ckpt = run.load()
    resumed = ckpt is not None
    if ckpt is None and init_from is not None:
        # continue from an exported run (weights and counters; the optimiser starts afresh)
        state = json.loads((Path(init_from) / "training_state.json").read_text())
        ckpt = {"model": load_drafter(init_from).state_dict(), "optimizer": None, **state}
    if ckpt is not None:
        cfg = EagleConfig(**ckpt["config"])
    else:
        over = {"feature_layers": list(feature_layers)} if feature_layers is not None else {}
        cfg = EagleConfig.for_target(target.cfg, **over)
    cfg.check(target.cfg)
    torch.manual_seed(seed)
    drafter = EagleDrafterModel(cfg).to(dev)
    if ckpt is not None:
        drafter.load_state_dict(ckpt["model"])
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    step, train_seconds, seqs_seen = 0, 0.0, 0
    if ckpt is not None:
        if ckpt["optimizer"] is not None:
            opt.load_state_dict(ckpt["optimizer"])
        step, train_seconds, seqs_seen = ckpt["step"], ckpt["train_seconds"], ckpt["sequences_seen"]
        total_steps = total_steps or ckpt.get("total_steps")
    net = wrap(_TTTLoss(drafter, unroll, step_decay), dev, run.distributed)

    train_idx, val_idx = dataset.split(val_fraction, seed)
    train = ResponseBatches(dataset, train_idx, batch_size, seq_len, seed, run.rank)
    val = ResponseBatches(dataset, val_idx, batch_size, seq_len)
    eval_batches = min(eval_batches, len(val))
    run.header(resumed or init_from is not None, config=dataclasses.asdict(cfg), target=str(target_dir),
               params=sum(p.numel() for p in drafter.parameters()), data=str(data),
               train_sequences=len(train_idx), val_sequences=len(val_idx), batch_size=batch_size * run.world,
               seq_len=seq_len, lr=lr, unroll=unroll)

    def save(step: int, train_seconds: float) -> None:
        run.save({"config": dataclasses.asdict(cfg), "model": drafter.state_dict(), "optimizer": opt.state_dict(),
                  "step": step, "train_seconds": train_seconds, "sequences_seen": seqs_seen,
                  "total_steps": run.clock.total_steps})

    drafter.train()

    def train_step(step: int):
        nonlocal seqs_seen
        clock = run.clock
        with clock.phase("batch"):
            tokens, valid = (t.to(dev, non_blocking=True) for t in train.get(step))
        with clock.phase("target"):
            hidden, emb, logp = target_side(target, tokens, cfg.feature_layers)
        cur_lr = clock.lr(step, lr, warmup)
        with clock.phase("update"):
            (loss, top1), gnorm = optimizer_step(opt, drafter.parameters(), cur_lr, dev,
                                                 lambda: net(hidden, emb, logp, valid, target.lm_head.weight))
        seqs_seen += batch_size * run.world
        return loss, top1, gnorm, cur_lr

    def after_step(step: int, train_seconds: float, result) -> None:
        loss, top1, gnorm, cur_lr = result
        if run.main and step % log_every == 0:
            run.bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{top1[0].item():.3f}")
            run.record({"step": step, "loss": round(loss.item(), 4), "top1": [round(x, 4) for x in top1.tolist()],
                        "lr": cur_lr, "grad_norm": round(float(gnorm), 3), "sequences": seqs_seen,
                        "train_seconds": round(train_seconds, 1)})

    step, train_seconds = run.steps(total_steps, total_minutes, max_minutes, checkpoint_minutes, step, train_seconds,
                                    train_step, after_step, save, "train drafter", progress,
                                    validate=lambda: evaluate(drafter, target, val, eval_batches, unroll, step_decay),
                                    eval_every=eval_every)
    save(step, train_seconds)
    metrics = run.metrics

    def export() -> None:
        out = save_drafter(drafter, run.out / "export", dtype=torch.bfloat16)
        (out / "training_state.json").write_text(json.dumps(
            {"config": dataclasses.asdict(cfg), "step": step, "train_seconds": train_seconds,
             "sequences_seen": seqs_seen, "total_steps": run.clock.total_steps, "target": str(target_dir),
             "unroll": unroll, **metrics}) + "\n")

    return run.close(step, train_seconds, export, sequences_seen=seqs_seen, **metrics)
