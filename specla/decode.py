"""The decode loop: prefill, then rounds of draft -> verify -> accept -> commit (DESIGN §2-5).

Without a drafter (route `ar`) one token is consumed per step through the plain sequence
path; with one, each round verifies the drafter's topology and commits the accepted path
from factor records (delayed by default: the GDN update is folded into the next verify).
Which drafter serves which route name is the API's business (`specla.api`).

The loop runs B rows at once (each row its own prompt, draft and acceptance). The public
API generates one sequence (B = 1); the batched form exists so tests can draw many samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specla import acceptance
from specla.drafters.base import DraftContext, Drafter
from specla.engine import EagerTarget, FlaTarget, GraphTarget
from specla.errors import InputError
from specla.model import Model

@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RoundStats:
    drafted: int  # draft nodes verified (root excluded)
    accepted: int  # draft tokens accepted
    emitted: int  # tokens emitted this round (accepted + the target's own token, after truncation)
    first_token_match: bool | None  # first (best-ranked) draft token == target's greedy token


@dataclass
class GenerationResult:
    tokens: list[int]
    route: str
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = "max_new_tokens"

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target call (accepted drafts + 1), as EAGLE's τ."""
        return sum(r.emitted for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def first_token_match(self) -> float:
        m = [r.first_token_match for r in self.rounds if r.first_token_match is not None]
        return sum(m) / len(m) if m else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Decoder:
    def __init__(self, model: Model, drafter: Drafter | None = None, route: str | None = None,
                 sampling: Sampling | None = None, delayed: bool = True,
                 eos_token_ids: tuple[int, ...] | set[int] = (), max_context: int | None = None,
                 prefill_chunk: int = 2048, graphs: bool | None = None, executor: str = "specla",
                 targets: dict | None = None):
        self.model = model
        self.route = route or (drafter.name if drafter is not None else "ar")
        self.drafter = drafter
        self.sampling = sampling or Sampling()
        self.delayed = delayed
        self.eos = set(int(e) for e in eos_token_ids)
        self.max_context = max_context or model.cfg.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        # CUDA graphs by default on CUDA; `graphs=False` keeps everything eager
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        if executor not in ("specla", "fla"):
            raise InputError(f"unknown executor {executor!r}")
        self.executor = executor  # "fla": the FLA-SD baseline (fla's model, token replay)
        # Targets (cache buffers and their CUDA graphs) kept across generations; pass the same
        # dict to later Decoders of the same model to reuse them.
        self.targets = {} if targets is None else targets

    # input checks ----------------------------------------------------------------------------
    def _check(self, prompts: torch.Tensor, max_new_tokens: int) -> None:
        if max_new_tokens <= 0:
            raise InputError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if prompts.shape[1] == 0:
            raise InputError("the prompt is empty")
        if prompts.shape[1] > self.max_context:
            raise InputError(f"the prompt has {prompts.shape[1]} tokens, more than the maximum context "
                             f"of {self.max_context}")
        V = self.model.cfg.vocab_size
        bad = (prompts < 0) | (prompts >= V)
        if bool(bad.any()):
            raise InputError(f"token id {int(prompts[bad][0])} is out of range for vocabulary size {V}")

    # the loop --------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        prompts = torch.tensor([list(prompt_ids)], dtype=torch.long)
        rows, result, _ = self.run(prompts, max_new_tokens, on_tokens)
        result.tokens = rows[0]
        return result

    def run(self, prompts: torch.Tensor, max_new_tokens: int,
            on_tokens: Callable[[list[int]], None] | None = None):
        """Generate for B prompts of equal length. Returns (tokens per row, stats of row 0, cache)."""
        self._check(prompts, max_new_tokens)
        dev = self.model.device
        prompts = prompts.to(dev)
        B, T = prompts.shape
        gen = None
        if not self.sampling.greedy:
            gen = torch.Generator(device=dev)
            gen.manual_seed(self.sampling.seed if self.sampling.seed is not None else torch.seed())
        capture = self.drafter.capture if self.drafter is not None else ()
        if self.drafter is not None:
            self.drafter.reset(B)
        result = GenerationResult(tokens=[], route=self.route)

        target = self._target(B, T + max_new_tokens + 64)
        cache = target.cache
        _sync(dev)
        t0 = time.perf_counter()
        for s in range(0, T - 1, self.prefill_chunk):
            chunk = prompts[:, s:min(s + self.prefill_chunk, T - 1)]
            out = target.prefill(chunk, capture)
            if self.drafter is not None:
                self.drafter.extend(chunk, out.hidden, torch.full((B,), chunk.shape[1], device=dev))
        _sync(dev)
        t1 = time.perf_counter()
        result.prefill_seconds = t1 - t0

        hist = prompts.tolist()
        emitted: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        root = prompts[:, -1]
        while not all(done):
            if self.drafter is None:
                new, stats = self._ar_step(target, root, gen)
            else:
                new, stats = self._spec_round(target, hist, gen, capture, emitted, done, max_new_tokens)
            for b in range(B):
                if done[b]:
                    continue
                toks = new[b][: self._emit_count(new[b], max_new_tokens - len(emitted[b]))]
                emitted[b] += toks
                hist[b] += toks
                if toks and toks[-1] in self.eos:
                    done[b] = True
                    if b == 0:
                        result.stop_reason = "eos"
                elif len(emitted[b]) >= max_new_tokens:
                    done[b] = True
                if b == 0:
                    stats.emitted = len(toks)
                    if on_tokens is not None and toks:
                        on_tokens(toks)
            result.rounds.append(stats)
            root = torch.tensor([h[-1] for h in hist], device=dev)
        target.flush()
        _sync(dev)
        result.decode_seconds = time.perf_counter() - t1
        return emitted, result, cache

    def _target(self, batch: int, max_len: int):
        if self.executor == "fla":
            return FlaTarget(self.model, batch, max_len)
        budget = self.drafter.max_nodes if self.drafter is not None else 1
        key = ("graph", batch, budget, self.delayed) if self.graphs else ("eager", batch)
        target = self.targets.get(key)
        if target is not None and target.max_len >= max_len:
            target.reset()
            return target
        # room in steps of 1024 positions: a slightly longer prompt reuses the target (and its
        # graphs) instead of building and capturing a new one
        max_len = -(-max_len // 1024) * 1024
        target = (GraphTarget(self.model, batch, max_len, budget, self.delayed) if self.graphs
                  else EagerTarget(self.model, batch, max_len))
        self.targets[key] = target
        return target

    def _emit_count(self, toks: list[int], room: int) -> int:
        """How many of a round's tokens are emitted: up to `room`, and through the first EOS."""
        for i, t in enumerate(toks[:room]):
            if t in self.eos:
                return i + 1
        return min(len(toks), room)

    def _ar_step(self, target, root, gen):
        logits = target.step(root)
        if self.sampling.greedy:
            nxt = logits.argmax(-1)
        else:
            p = acceptance.target_probs(logits, self.sampling.temperature, self.sampling.top_p)
            nxt = torch.multinomial(p, 1, generator=gen).squeeze(1)
        return [[t] for t in nxt.tolist()], RoundStats(0, 0, 1, None)

    def _spec_round(self, target, hist, gen, capture, emitted, done, max_new_tokens):
        draft = self.drafter.propose(DraftContext(hist, target.cache, self.sampling.temperature, gen))
        tokens = draft.tokens.to(self.model.device)
        parents = draft.parents.to(self.model.device)
        valid = draft.valid.to(self.model.device) if draft.valid is not None else None
        out, acc = target.verify(tokens, parents, capture, greedy=self.sampling.greedy, valid=valid)
        if acc is None:
            acc = acceptance.sample(tokens, parents, out.logits, draft.probs,
                                    self.sampling.temperature, self.sampling.top_p, gen, valid)
        B = tokens.shape[0]
        rows = torch.arange(B, device=tokens.device)[:, None]
        width = acc.path.shape[1]
        padded = tokens if tokens.shape[1] == width else torch.cat(
            [tokens, tokens[:, -1:].expand(-1, width - tokens.shape[1])], 1)
        path_tokens = padded[rows, acc.path]  # [B, width]; root first
        # First-token match: does the root's first child (drafters put their best child first)
        # carry the target's greedy token? -1 where the root has no real child.
        first = torch.full_like(acc.bonus, -1)
        if tokens.shape[1] > 1:
            real = parents[:, 1] == 0
            if valid is not None:
                real &= valid > 1
            first = torch.where(real, tokens[:, 1], first)
        top = out.logits[:, 0].argmax(-1)
        drafted = (valid if valid is not None else torch.full_like(acc.length, tokens.shape[1])) - 1
        # one device-to-host copy per round: what was accepted, and the statistics
        packed = torch.cat([acc.length[:, None], acc.bonus[:, None], first[:, None], top[:, None],
                            drafted[:, None], path_tokens], 1).tolist()
        new, commit = [], []
        for b, row in enumerate(packed):
            length, bonus, path = row[0], row[1], row[5:]
            toks = path[1:length] + [bonus]
            r = 0 if done[b] else self._emit_count(toks, max_new_tokens - len(emitted[b]))
            new.append(toks[:r])
            commit.append(r)  # consumes the root and the first r - 1 accepted drafts
        length = torch.tensor(commit, device=tokens.device)
        target.commit(out.records, acc.path, length, delayed=self.delayed)
        hidden = {i: h[rows, acc.path] for i, h in out.hidden.items()}
        self.drafter.extend(path_tokens, hidden, length)
        first0, top0, drafted0 = packed[0][2:5]
        return new, RoundStats(drafted0, packed[0][0] - 1, 0, None if first0 < 0 else first0 == top0)
