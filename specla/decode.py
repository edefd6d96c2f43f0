"""The decode loop: prefill, then rounds of draft -> verify -> accept -> commit (DESIGN §2-5).

Without a drafter (route `ar`) one token is consumed per step through the plain sequence
path (in exact mode, through the same verify as every other route); with one, each round verifies the drafter's topology and commits the accepted path
from factor records (delayed by default: the GDN update is folded into the next verify).
What a round emits (EOS, token budget) is settled on the device (`acceptance.emit`); the
host reads one small report per round — on CUDA graphs one round late, while the next
round runs. Which drafter serves which route name is the API's business (`specla.api`).

The loop runs B rows at once (each row its own prompt, draft and acceptance). The public
API generates one sequence (B = 1); the batched form exists so tests can draw many samples.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from specla import acceptance
from specla.drafters.base import DraftContext, Drafter
from specla.engine import EagerTarget, FlaTarget, GraphTarget
from specla.errors import InputError
from specla.model import Model

# Exact mode's verify width: the default routes' largest draft (a 16-node tree) plus the root.
EXACT_WIDTH = 17

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


class _Reader:
    """Round reports copied to the host without blocking, two in flight: on CUDA into pinned
    buffers, each with an event to wait for; elsewhere a plain copy."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.bufs, self.events, self.k = [None, None], [None, None], 0

    def send(self, rep: torch.Tensor) -> int:
        i = self.k % 2
        self.k += 1
        if not self.cuda:
            self.bufs[i] = rep.clone()
            return i
        if self.bufs[i] is None or self.bufs[i].shape != rep.shape:
            self.bufs[i] = torch.empty(rep.shape, dtype=rep.dtype, pin_memory=True)
            self.events[i] = torch.cuda.Event()
        self.bufs[i].copy_(rep, non_blocking=True)
        self.events[i].record()
        return i

    def recv(self, i: int) -> list[list[int]]:
        if self.cuda:
            self.events[i].synchronize()
        return self.bufs[i].tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_spans(T: int, chunk: int = 2048) -> list[tuple[int, int]]:
    """(start, end) of each `target.prefill` call for a T-token prompt: all but the last token
    (the first round's root), at most `chunk` tokens a call."""
    return [(s, min(s + chunk, T - 1)) for s in range(0, T - 1, chunk)]


class Decoder:
    def __init__(self, model: Model, drafter: Drafter | None = None, route: str | None = None,
                 sampling: Sampling | None = None, delayed: bool = True,
                 eos_token_ids: tuple[int, ...] | set[int] = (), max_context: int | None = None,
                 prefill_chunk: int = 2048, graphs: bool | None = None, executor: str = "specla",
                 targets: dict | None = None, pipeline: bool = True, exact_width: int | None = None):
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
        # graphed greedy decoding runs rounds ahead of the host (`_runs_ahead`); False: one host
        # read between rounds (the loop every other case takes)
        self.pipeline = pipeline
        # exact mode: every target call (AR steps too) verifies `exact_width` nodes, so each
        # position is computed by the same arithmetic on every route (docs/exact.md)
        self.exact_width = exact_width
        if exact_width is not None:
            need = drafter.max_nodes if drafter is not None else 1
            if need > exact_width:
                raise InputError(f"route {self.route!r} drafts up to {need - 1} nodes, more than exact mode's "
                                 f"verify width of {exact_width} (root included) allows")
            if executor == "fla":
                raise InputError("exact mode runs on specla's own verify; the fla baseline has none")
            cfg = model.cfg
            tree = drafter is not None and not drafter.chain
            if cfg.num_experts or (cfg.attention_layers and tree):
                # MoE experts batch a varying number of tokens; a tree node's attention keys sit
                # after the cache, not at their positions (`GatedAttention.verify`)
                warnings.warn("exact mode is bit-exact for pure GDN targets, and for dense hybrid targets on "
                              f"chain routes; this {'MoE' if cfg.num_experts else 'hybrid'} target's "
                              f"{'experts' if cfg.num_experts else 'attention on draft trees'} still round "
                              "differently across routes (docs/exact.md)", stacklevel=2)
            if model.device.type == "cpu" and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
                # the vectorised kernels round a loop's scalar tail differently (docs/exact.md)
                warnings.warn("exact mode on CPU is bit-exact only with torch's portable kernels: set "
                              "ATEN_CPU_CAPABILITY=default before starting Python", stacklevel=2)

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
        lo, hi = prompts.aminmax()  # one op: this runs before every generation
        if lo < 0 or hi >= V:
            bad = (prompts < 0) | (prompts >= V)
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
        result = GenerationResult(tokens=[], route=self.route)
        target = self.start(B, T + max_new_tokens)
        cache = target.cache
        _sync(dev)
        t0 = time.perf_counter()
        self.prefill(target, prompts)
        _sync(dev)
        t1 = time.perf_counter()
        result.prefill_seconds = t1 - t0

        target.begin(prompts[:, -1], max_new_tokens, self.eos)
        ahead = self._runs_ahead(target)
        hist = None if ahead else prompts.tolist()  # host drafters read the history
        reader = _Reader(dev)
        emitted: list[list[int]] = [[] for _ in range(B)]
        pending = None  # a round sent but not yet read (running ahead)
        while True:
            sent = reader.send(self._round(target, hist, gen))
            if ahead and pending is None:
                pending = sent  # queue the next round before reading this one
                continue
            got, pending = (pending, sent) if ahead else (sent, None)
            if self._absorb(reader.recv(got), emitted, hist, result, on_tokens):
                break  # every row is done; a round still in flight emits and commits nothing
        target.flush()
        _sync(dev)
        result.decode_seconds = time.perf_counter() - t1
        return emitted, result, cache

    def start(self, batch: int, max_len: int):
        """A fresh target (and drafter) for a generation of up to max_len positions."""
        if self.drafter is not None:
            self.drafter.reset(batch, horizon=max_len)  # acceptance cuts at the room left
        return self._target(batch, max_len + 64)

    def prefill(self, target, prompts: torch.Tensor) -> None:
        """Consume all but the last prompt token (the first round's root) into the target and
        the drafter."""
        B, T = prompts.shape
        for s, e in prefill_spans(T, self.prefill_chunk):
            chunk = prompts[:, s:e]
            out = target.prefill(chunk, self.capture, logits=False)
            if self.drafter is not None:
                self.drafter.extend(chunk, out.hidden, torch.full((B,), chunk.shape[1], device=chunk.device))

    def _runs_ahead(self, target) -> bool:
        """Whether round r + 1 is queued before the host reads round r: greedy rounds on CUDA
        graphs whose drafter (if any) drafts from the device root, so the GPU never waits on
        Python between rounds. Otherwise the host reads each round before the next."""
        return (self.pipeline and isinstance(target, GraphTarget) and self.sampling.greedy
                and (self.drafter is None or self.drafter.device_root))

    @property
    def capture(self) -> tuple:
        """Target layers whose hidden states the drafter reads."""
        return self.drafter.capture if self.drafter is not None else ()

    def _round(self, target, hist, gen) -> torch.Tensor:
        """Launch one round (an AR step without a drafter); its report [B, ...] on the device."""
        s = self.sampling
        if self.drafter is None:
            return target.ar_round(s.temperature, s.top_p, gen)
        draft = self.drafter.propose(DraftContext(hist, target.cache, s.temperature, gen, root=target.next_root))
        dev = self.model.device
        r = target.round(draft.tokens.to(dev), draft.parents.to(dev), self.capture,
                         None if draft.valid is None else draft.valid.to(dev), draft.probs, s.temperature, s.top_p,
                         gen, self.delayed, self.drafter.chain, draft.static)
        self.drafter.extend(r.path_tokens, r.hidden, r.count, static=r.static)
        return r.report

    def _absorb(self, rows: list[list[int]], emitted, hist, result, on_tokens) -> bool:
        """Take one round's report (`acceptance.report`); True when every row is done."""
        H = acceptance.REPORT_HEAD
        for b, row in enumerate(rows):
            count, length, first, top, drafted, _ = row[:H]
            toks = row[H:H + count]
            emitted[b] += toks
            if hist is not None:
                hist[b] += toks
            if b == 0:
                if toks and toks[-1] in self.eos:
                    result.stop_reason = "eos"
                result.rounds.append(RoundStats(drafted, length - 1, count, None if first < 0 else first == top))
                if on_tokens is not None and toks:
                    on_tokens(toks)
        if self.drafter is not None:
            self.drafter.observe([row[1] - 1 for row in rows])
        return all(row[H - 1] for row in rows)

    def _target(self, batch: int, max_len: int):
        if self.executor == "fla":
            return FlaTarget(self.model, batch, max_len)
        exact = self.exact_width is not None
        budget = self.exact_width or (self.drafter.max_nodes if self.drafter is not None else 1)
        path = self.drafter.max_path if self.drafter is not None else 1
        max_len += budget  # a chain verify writes its nodes' K/V up to `budget` slots past the end
        key = (("graph", batch, budget, self.delayed, exact, path) if self.graphs
               else ("eager", batch, self.exact_width, path))
        target = self.targets.get(key)
        if target is not None and target.max_len >= max_len:
            target.reset()
            return target
        # room in steps of 1024 positions: a slightly longer prompt reuses the target (and its
        # graphs) instead of building and capturing a new one
        max_len = -(-max_len // 1024) * 1024
        target = (GraphTarget(self.model, batch, max_len, budget, self.delayed, exact, path) if self.graphs
                  else EagerTarget(self.model, batch, max_len, self.exact_width, path))
        self.targets[key] = target
        return target
