"""Target-side execution for the decode loop: eager, replayed from CUDA graphs, or fla's.

The decode loop needs prefill and rounds: `round` (verify a draft, accept, settle what is
emitted on the device, commit exactly that, report) and `ar_round` (one AR step, settled
the same way). `EagerTarget` runs them as plain PyTorch on any device. With a `width` (exact mode) every
verify is padded to that many nodes and an AR step is a verify of the root alone, so every
position is computed by the same arithmetic whatever the route: the output is bit-identical
to this AR in any precision (`docs/exact.md`). `GraphTarget` (CUDA)
captures them over static buffers: the cache is allocated once and updated in place,
topologies are padded to a fixed node budget, and a greedy round is one graph replay that
needs nothing from the host, so the loop can queue the next round before reading this one
(`decode.Decoder`). `FlaTarget` is the paper's FLA-SD baseline: fla's own model and kernels,
path replay, token-replay commit. Separate verify / commit graphs remain for the benchmarks
that time those phases.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from dataclasses import dataclass

import torch

from specla import acceptance, fused, graphs, ops
from specla.drafters.base import pad_draft
from specla.model import Model, ModelOutput
from specla.ops.beam.naive import first_max
from specla.state import Cache, GDNLayerState, commit_stacked

# GraphTarget's prefill: a prompt shorter than SEQUENCE_FROM tokens goes as chains of
# PREFILL_WIDTH tokens, each verified and committed in one graph replay; a longer one as plain
# sequences through the fused regions and fla's chunk kernel, each padded to the smallest of
# SEQUENCE_WIDTHS that holds it (the longest one repeated for longer prompts), one replay each.
# 2026-12-02 H200 e2e, demo pair: the plain path cost ~8 ms a prompt below 512 tokens and a
# median ~25 ms from 512 on, nearly all host time (a compiled region call per layer and phase);
# a chain replay costs 0.63 ms a 32-token chunk.
PREFILL_WIDTH = 32
# `specla bench prefill` on the H200 (prefill_ef49ee7.json): sequences through the fused regions
# cost 0.96-1.0 ms at 64 tokens, 1.04 at 128, 1.19 at 256, 1.35 at 512; chains 0.58 ms at 16
# tokens, 0.84 at 32 and 1.39 at 48 (two chunks). So chains take one chunk's worth, sequences
# the rest. (On the plain modules, ~50 kernels a layer, a padded 512-token sequence cost 2.6 ms
# whatever its length: prefill.json, bebcf18.)
SEQUENCE_FROM = PREFILL_WIDTH + 1
SEQUENCE_WIDTHS = (64, 128, 256, 512)
# `SPECLA_PREFILL=plain`: every prefill takes the plain forward (the A/B switch for benchmarks)
PREFILL = os.environ.get("SPECLA_PREFILL", "graph")
if PREFILL not in ("graph", "plain"):
    raise ValueError(f"SPECLA_PREFILL={PREFILL!r}: expected graph or plain")


def preferred_prefill_mode(T: int) -> str:
    """How a T-token prompt is prefilled where nothing stops its chunks being captured."""
    return "chain" if T < SEQUENCE_FROM else "sequence"


def prefill_chunks(T: int, mode: str) -> list[tuple[int, int]]:
    """(start, width) of each graph-replayed chunk of a T-token prompt: chains of PREFILL_WIDTH,
    or sequences of the longest SEQUENCE_WIDTHS with the rest in the smallest that holds it."""
    if mode == "chain":
        return [(s, PREFILL_WIDTH) for s in range(0, T, PREFILL_WIDTH)]
    top = max(SEQUENCE_WIDTHS)
    chunks = [(s, top) for s in range(0, T - T % top, top)]
    if T % top:
        chunks.append((T - T % top, min(w for w in SEQUENCE_WIDTHS if w >= T % top)))
    return chunks


def prompt_chunks(T: int) -> list[tuple[int, int]]:
    """`prefill_chunks` of a T-token prompt in the mode it prefers: the chunk widths a graphed
    prefill replays (the target's, and the EAGLE drafter's over the same tokens)."""
    return prefill_chunks(T, preferred_prefill_mode(T))


@dataclass
class Round:
    """What a settled round hands on: the accepted path's tokens [B, W] (root first) and their
    captured hidden states (the drafter's `extend` input), `count` [B] tokens emitted and
    consumed, and the report [B, acceptance.REPORT_HEAD + W] the host reads."""

    path_tokens: torch.Tensor
    hidden: dict[int, torch.Tensor]
    count: torch.Tensor
    report: torch.Tensor
    # a CUDA graph's outputs: the same storage every round, refreshed in place, so a graphed
    # drafter's `extend` may read them where they are (`Drafter.extend`)
    static: bool = False


def settle(tokens, parents, valid, logits, hidden, acc, emitted, done, room, eos, next_root):
    """`acceptance.emit` + `acceptance.report` for a verified round on a target's buffers
    (emitted, done, next_root updated in place; next_root becomes each row's last emitted
    token). Returns what `Round` holds, as a tuple (a compiled function returns tensors)."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
    path_tokens = tokens[rows, acc.path]
    toks, count = acceptance.emit(path_tokens, acc, emitted, done, room, eos)
    rep = acceptance.report(tokens, parents, valid, logits, acc, toks, count, done)
    last = toks.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
    next_root.copy_(torch.where(count > 0, last, next_root))
    return path_tokens, {i: h[rows, acc.path] for i, h in hidden.items()}, count, rep


def greedy_settle(tokens, parents, valid, logits, hidden, emitted, done, room, eos, next_root):
    """`acceptance.greedy`, then `settle`: (the accepted path, what `Round` holds) — a greedy
    round's bookkeeping, which `GraphTarget` compiles as one region."""
    acc = acceptance.greedy(tokens, parents, logits, valid)
    return acc.path, settle(tokens, parents, valid, logits, hidden, acc, emitted, done, room, eos, next_root)


class EagerTarget:
    _settle_fn = staticmethod(settle)
    _accept = staticmethod(acceptance.greedy)  # the greedy rule; GraphTarget's is compiled
    _top1 = staticmethod(first_max)  # an AR step's greedy token; GraphTarget's is compiled

    def __init__(self, model: Model, batch: int, max_len: int, width: int | None = None,
                 path_nodes: int | None = None):
        from specla.fused import maybe_fuse

        maybe_fuse(model)  # SPECLA_COMPILE=1: the fused decode path (specla.fused)
        self.model = model
        self.max_len = max_len
        self.width = width  # exact mode: every target call verifies this many nodes
        # the longest path a round can accept, root included (`Drafter.max_path`; None: the
        # topology's width): commits keep that much of a path, so the pending buffers, whose
        # every slot each verify checks, are a tree's depth long, not its node count
        self.path_nodes = path_nodes
        self.cache: Cache = model.new_cache(batch, max_len=max_len)
        self._emission(batch, model.device)

    def _emission(self, batch: int, dev) -> None:
        """The device's side of the decode loop (`begin`, `round`, `ar_round`): each round's
        output is settled here (`acceptance.emit`), so the host only reads a report, and on
        CUDA graphs may read it while the next round runs."""
        self.next_root = torch.zeros(batch, dtype=torch.long, device=dev)
        self.emitted = torch.zeros(batch, dtype=torch.long, device=dev)
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.room = torch.zeros(batch, dtype=torch.long, device=dev)
        self.eos = torch.full((8,), -1, dtype=torch.long, device=dev)  # ids; -1 pads

    def reset(self) -> None:
        """Empty the cache in place, so a new generation reuses its buffers (and graphs)."""
        buffers = [self.cache.length] + [t[-1] if isinstance(t, tuple) else t  # pending: nothing left to apply
                                         for st in self.cache.layers for t in vars(st).values()]
        groups: dict = {}  # a multi-tensor launch per dtype, not a memset per buffer (~40 host launches)
        for t in buffers:
            if isinstance(t, torch.Tensor):
                groups.setdefault((t.device, t.dtype), []).append(t)
        for ts in groups.values():
            torch._foreach_zero_(ts)
        self.cache.clean = True

    def prefill(self, tokens: torch.Tensor, capture=(), logits: bool = True) -> ModelOutput:
        """Consume a prompt; `logits` False: no LM head (the decode loop reads only the captured
        layers: a prompt's last token is the first round's root)."""
        return self.model.forward(tokens, self.cache, capture, logits=logits)

    def step(self, root: torch.Tensor) -> torch.Tensor:
        """Consume the root [B]; the next-token logits [B, V]."""
        return self.model.forward(root[:, None], self.cache).logits[:, -1]

    def verify(self, tokens, parents, capture=(), greedy=True, valid=None, chain=False):
        """Score a topology; with `greedy`, also accept: (ModelOutput, Acceptance | None).

        `valid` [B]: real nodes per row; the rest is padding acceptance ignores. `chain`: the
        topology is a chain (`Model.verify`)."""
        out = self._model_verify(tokens, parents, capture, chain, valid)
        acc = self._accept(tokens, parents, out.logits, valid) if greedy else None
        return out, acc

    def _model_verify(self, tokens, parents, capture, chain, valid):
        # exact mode: the verifiers whose arithmetic an AR step shares (ops.exact_arithmetic)
        with ops.exact_arithmetic(self.width is not None):
            return self.model.verify(tokens, parents, self.cache, capture, chain, valid)

    def commit(self, records, path, length, delayed: bool) -> None:
        self.cache.commit(records, self._accepted(path), length, delayed)

    def _accepted(self, path: torch.Tensor) -> torch.Tensor:
        return path if self.path_nodes is None else path[:, :self.path_nodes]

    def flush(self) -> None:
        self.cache.flush()

    # the decode loop's rounds -----------------------------------------------------------------
    def begin(self, root: torch.Tensor, max_new_tokens: int, eos: set[int]) -> None:
        """Start a generation: the first root, the token budget and the EOS ids."""
        if len(eos) > self.eos.numel():  # rare: a new buffer, and graphs that read the old one go
            self.eos = torch.full((len(eos),), -1, dtype=torch.long, device=self.eos.device)
            getattr(self, "graphs", {}).clear()
        self.next_root.copy_(root)
        self.emitted.zero_()
        self.done.zero_()
        self.room.fill_(max_new_tokens)
        self.eos.fill_(-1)
        if eos:
            self.eos[:len(eos)].copy_(torch.tensor(sorted(eos), device=self.eos.device))

    def round(self, tokens, parents, capture=(), valid=None, probs=None, temperature=0.0, top_p=1.0,
              generator=None, delayed=True, chain=False, static=False):
        """One speculative round from `next_root`'s draft: verify, accept (greedy, or lossless
        sampling with the draft's `probs`), settle what is emitted and commit exactly that.
        `chain`: the drafter only proposes chains (padding keeps them chains). `static`: the
        draft is a graph's outputs (`Draft.static`; only `GraphTarget` reads them in place)."""
        if self.width is not None:
            n = tokens.shape[1]
            tokens, parents, valid = pad_draft(tokens, parents, valid, self.width)
            if probs is not None:  # padding nodes are past `valid`: any distribution will do
                probs = torch.cat([probs, probs[:, -1:].expand(-1, self.width - n, *probs.shape[2:])], 1)
        out, acc = self.verify(tokens, parents, capture, temperature == 0, valid, chain)
        if acc is None:
            acc = acceptance.sample(tokens, parents, out.logits, probs, temperature, top_p, generator, valid)
        settled = self._settle(tokens, parents, valid, out.logits, out.hidden, acc)
        self.commit(out.records, acc.path, settled.count, delayed)
        return settled

    def ar_round(self, temperature=0.0, top_p=1.0, generator=None) -> torch.Tensor:
        """One AR step from `next_root`: its token drawn (argmax, or sampled) and settled; the
        report. Rows already done still consume a token: their state is never read again.
        Exact mode: a round on the root alone, through the verify every route runs."""
        if self.width is not None:
            root = self.next_root[:, None].clone()
            return self.round(root, torch.full_like(root, -1), temperature=temperature, top_p=top_p,
                              generator=generator, chain=True).report
        return self._ar_settle(self.step(self.next_root), None if temperature == 0 else (temperature, top_p, generator))

    def _ar_settle(self, logits: torch.Tensor, sampling) -> torch.Tensor:
        root = self.next_root.clone()
        if sampling is None:
            nxt = self._top1(logits)[1]
        else:
            temperature, top_p, generator = sampling
            nxt = torch.multinomial(acceptance.target_probs(logits, temperature, top_p), 1,
                                    generator=generator).squeeze(1)
        B, dev = root.shape[0], root.device
        acc = acceptance.Acceptance(torch.zeros(B, 1, dtype=torch.long, device=dev),
                                    torch.ones(B, dtype=torch.long, device=dev), nxt)
        return self._settle(root[:, None], torch.full_like(root[:, None], -1), None, logits[:, None], {}, acc).report

    def _settle(self, tokens, parents, valid, logits, hidden, acc) -> Round:
        return Round(*self._settle_fn(tokens, parents, valid, logits, hidden, acc, self.emitted, self.done,
                                      self.room, self.eos, self.next_root))


class GraphTarget(EagerTarget):
    """CUDA graphs over a static cache; topologies padded to `budget` nodes (root included).
    `exact`: AR steps verify the root at that width too (exact mode)."""

    def __init__(self, model: Model, batch: int, max_len: int, budget: int, delayed: bool, exact: bool = False,
                 path_nodes: int | None = None):
        super().__init__(model, batch, max_len, budget if exact else None, min(path_nodes or budget, budget))
        dev = model.device
        # a one-node budget never accepts a draft: commit at once, so AR steps have no
        # (empty) pending update to flush in every layer
        self.budget, self.delayed = budget, delayed and budget > 1
        self.root = torch.zeros(batch, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(batch, budget, dtype=torch.long, device=dev)
        self.parents = torch.arange(-1, budget - 1, device=dev).expand(batch, -1).contiguous()
        self.valid = torch.full((batch,), budget, dtype=torch.long, device=dev)
        self.path = torch.zeros(batch, self.path_nodes, dtype=torch.long, device=dev)
        self.length = torch.zeros(batch, dtype=torch.long, device=dev)
        self.graphs: dict = {}
        self.records, self.verify_key = None, None
        self._prefill_buffers: dict = {}  # (mode, width) -> tokens, valid (+ a chain's parents, path)
        # greedy acceptance walks the nodes one by one (~8 small ops per node) and settling a
        # round is ~40 more; beside a fused model both are compiled: a few kernels per graph.
        # A greedy round compiles them as one region, as it does its commit's stacked work, both
        # with combo kernels: on an H100 the kernels after the verify went from 17 (four regions,
        # or two without combo kernels) to 13, 52 -> 39 µs with their gaps
        # (graph_timeline_tail_677faf1_h100.json, graph_timeline_combo_c39a339_h100.json)
        mode = fused.mode_of(model)
        self._accept, _ = fused.compile_for_graph(acceptance.greedy, mode)
        self._settle_fn, _ = fused.compile_for_graph(settle, mode)
        self._greedy_settle, _ = fused.compile_for_graph(greedy_settle, mode, combo=True)
        # eagerly the AR step's top-1 over the vocabulary was two 4.3 µs reductions (H200,
        # graph_timeline_a147b95_h200.json); compiled, as a round's acceptance is
        self._top1, _ = fused.compile_for_graph(first_max, mode)
        self.cache.commit_tensors, _ = fused.compile_for_graph(commit_stacked, mode, combo=True)
        # uncompiled, the stacked conv commit is slower than the per-layer kernel
        self.cache.stack_convs = mode is not None
        if self.delayed:  # pending buffers exist from the start so the verify graph reads them
            self.cache.reserve_pending(batch, self.path_nodes, (model.cfg.num_heads, model.cfg.head_dim))

    def _snapshot(self):
        keep = []
        for st in self.cache.layers:
            if isinstance(st, GDNLayerState):
                keep.append([t for t in (st.S, st.conv) if t is not None]
                            + (list(st.pending) if st.pending is not None else []))
            else:
                keep.append([st.k, st.v])
        keep.append([self.cache.length, self.next_root, self.emitted, self.done])
        return [[t, t.clone()] for ts in keep for t in ts]

    def _capture(self, key, fn):
        """Warm up and capture `fn` without changing the cache: its state is restored after."""
        dev = self.model.device
        # streams and graph on the model's GPU (elsewhere only an emulated capture runs: tests)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            saved = self._snapshot()
            fused = getattr(self.model, "_fused", None)  # the fused path must not compile in a capture
            try:
                graph = graphs.capture(fn, fused.capturing() if fused is not None else None)
            finally:
                for t, backup in saved:
                    t.copy_(backup)
        self.graphs[key] = (graph, graph.out)
        return self.graphs[key]

    def prefill(self, tokens, capture=(), mode: str | None = None, logits: bool = True):
        """The prompt in fixed-width chunks, one graph replay each (`prefill_chunks`): below
        SEQUENCE_FROM tokens padded chains verified and committed, from there plain sequences;
        `valid` stops the recurrence, the conv and the commit at a chunk's real length.
        `SPECLA_PREFILL=plain` takes the plain forward, as does a prompt whose chunks cannot be
        captured (`_capturable`). mode: force "chain", "sequence" or "plain" (`prefill_mode`;
        `bench prefill` times each). `logits` False: sequences skip the LM head and no chunk's
        logits are copied out (at the 1.3B shape a 512-token chunk's are 33 MB)."""
        B, T = tokens.shape
        mode = self.prefill_mode(T, mode)
        if mode == "plain":
            return super().prefill(tokens, capture, logits)
        outs, hidden = [], {i: [] for i in capture}
        for s, W in prefill_chunks(T, mode):
            n = min(W, T - s)
            graph, tok, valid, (lg, hid) = self._prefill_graph(mode, W, B, tuple(capture), logits)
            tok[:, :n].copy_(tokens[:, s:s + n])
            valid.fill_(n)
            graph.replay()
            if logits:
                outs.append(lg[:, :n].clone())
            for i in capture:
                hidden[i].append(hid[i][:, :n].clone())
        def join(parts):  # most prompts are one chunk: no concatenation (a launch each)
            return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

        return ModelOutput(join(outs) if logits else None, {i: join(h) for i, h in hidden.items()})

    def _prefill_graph(self, mode: str, W: int, B: int, capture: tuple, logits: bool = True):
        """(graph, its token and valid buffers, its outputs) of a W-wide prefill chunk."""
        dev = self.model.device
        if (mode, W) not in self._prefill_buffers:
            chain = [torch.arange(-1, W - 1, device=dev).expand(B, -1).contiguous(),  # parents
                     torch.arange(W, device=dev).expand(B, -1).contiguous()] if mode == "chain" else []  # path
            self._prefill_buffers[mode, W] = (torch.zeros(B, W, dtype=torch.long, device=dev),
                                              torch.zeros(B, dtype=torch.long, device=dev), *chain)
        tok, valid, *chain = self._prefill_buffers[mode, W]
        key = ("prefill", mode, W, capture, logits or mode == "chain")  # a chain's verify has its head

        def run():
            if mode == "sequence":
                out = self.model.forward(tok, self.cache, capture, valid, logits)
            else:  # a chain verified, and committed up to `valid` (a verify's head always runs)
                par, path = chain
                out = self._model_verify(tok, par, capture, True, valid)
                self.cache.commit(out.records, path, valid, False)
            return out.logits, out.hidden

        graph, out = self.graphs.get(key) or self._capture(key, run)
        return graph, tok, valid, out

    def prefill_mode(self, T: int, mode: str | None = None) -> str:
        """How `prefill` consumes T tokens: "chain" below SEQUENCE_FROM tokens, "sequence" from
        there (chains where sequences cannot be captured: their padding would overrun a K/V
        cache), "plain" under SPECLA_PREFILL=plain; a chain or sequence (also a forced one) that
        cannot be captured here runs plain."""
        if mode is None:
            if PREFILL == "plain":
                return "plain"
            modes = dict.fromkeys((preferred_prefill_mode(T), "chain"))  # chains where sequences overrun
            return next((m for m in modes if self._capturable(T, m)), "plain")
        if mode not in ("chain", "sequence", "plain"):
            raise ValueError(f"prefill mode {mode!r}: expected chain, sequence or plain")
        return mode if mode == "plain" or self._capturable(T, mode) else "plain"

    def _capturable(self, T: int, mode: str) -> bool:
        """Whether T tokens go as chunks of this mode from a graph: every MoE layer takes its
        gather path at the chunk's width, and the prompt padded to whole chunks fits every K/V
        cache (a chunk, chain or sequence, writes K/V at all its positions; one host read,
        before the first replay)."""
        from specla.moe import SparseMoE

        chunks = prefill_chunks(T, mode)
        if any(isinstance(blk.mlp, SparseMoE) and not blk.mlp.gathers(W)
               for blk in self.model.layers for W in {w for _, w in chunks}):
            return False
        sizes = [st.k.shape[2] for st in self.cache.layers if not isinstance(st, GDNLayerState)]
        return not sizes or int(self.cache.length.max()) + chunks[-1][0] + chunks[-1][1] <= min(sizes)

    def step(self, root):
        self.root.copy_(root)
        graph, out = self.graphs.get("step") or self._capture(
            "step", lambda: self.model.forward(self.root[:, None], self.cache).logits[:, -1])
        graph.replay()
        return out

    def _stage(self, tokens, parents, valid) -> None:
        """Write a draft into the static buffers, padded to the budget (`pad_draft`)."""
        pad_draft(tokens, parents, valid, self.budget, out=(self.tokens, self.parents, self.valid))

    def verify(self, tokens, parents, capture=(), greedy=True, valid=None, chain=False):
        if not greedy:  # sampling draws random numbers: run eagerly on the same buffers
            return super().verify(tokens, parents, capture, greedy, valid, chain)
        self._stage(tokens, parents, valid)
        key = ("verify", tuple(capture), chain)

        def run():
            out = self._model_verify(self.tokens, self.parents, capture, chain, self.valid)
            return out, self._accept(self.tokens, self.parents, out.logits, self.valid)

        graph, (out, acc) = self.graphs.get(key) or self._capture(key, run)
        graph.replay()
        self.records, self.verify_key = out.records, key
        return out, acc

    def commit(self, records, path, length, delayed):
        delayed = delayed and self.budget > 1
        if records is not self.records or delayed != self.delayed:
            return super().commit(records, path, length, delayed)
        self.path.copy_(self._accepted(path))
        self.length.copy_(length)
        # one commit graph per verify graph: a graph reads the records it was captured with, and
        # drafters that capture different layers (one target serves every drafter of a budget)
        # verify through different graphs with different records
        key = ("commit", self.verify_key)
        records = self.records
        graph, _ = self.graphs.get(key) or self._capture(
            key, lambda: self.cache.commit(records, self.path, self.length, self.delayed))
        self._replay_commit(graph)

    def _replay_commit(self, graph) -> None:
        """Replay a graph that commits; a delayed commit leaves a pending update behind, which
        the host must know (`Cache.clean`: the replay runs no Python)."""
        graph.replay()
        self.cache.clean = self.cache.clean and not self.delayed

    def round(self, tokens, parents, capture=(), valid=None, probs=None, temperature=0.0, top_p=1.0,
              generator=None, delayed=True, chain=False, static=False):
        """Greedy: the whole round in one graph (verify, accept, settle, commit the emitted
        tokens). Sampling: eagerly, through the same buffers. A `static` draft of the full
        budget (a drafter graph's outputs) is read where it is, by a graph of its own: staging
        it cost four copies a round (the drafter's rollout graph is replayed per attention
        window, each with its own outputs, so one round graph per window)."""
        if temperature != 0:
            return super().round(tokens, parents, capture, valid, probs, temperature, top_p, generator, delayed,
                                 chain)
        if static and valid is not None and tokens.shape == self.tokens.shape:
            src = (tokens, parents, valid)
            key = ("round", tuple(capture), chain, *(t.data_ptr() for t in src))
        else:
            self._stage(tokens, parents, valid)
            src = (self.tokens, self.parents, self.valid)
            key = ("round", tuple(capture), chain)

        def run():
            tok, par, val = src
            out = self._model_verify(tok, par, capture, chain, val)
            path, settled = self._greedy_settle(tok, par, val, out.logits, out.hidden, self.emitted, self.done,
                                                self.room, self.eos, self.next_root)
            settled = Round(*settled)
            self.cache.commit(out.records, self._accepted(path), settled.count, self.delayed, chain)
            return dataclasses.replace(settled, static=True)

        graph, outs = self.graphs.get(key) or self._capture(key, run)
        self._replay_commit(graph)
        return outs

    def ar_round(self, temperature=0.0, top_p=1.0, generator=None) -> torch.Tensor:
        """Greedy: the step and its settling in one graph. Sampling: the step's graph, then an
        eager draw. Exact mode: a round (`EagerTarget.ar_round`)."""
        if temperature != 0 or self.width is not None:
            return super().ar_round(temperature, top_p, generator)
        graph, rep = self.graphs.get("ar_round") or self._capture("ar_round", lambda: self._ar_settle(
            self.model.forward(self.next_root[:, None], self.cache).logits[:, -1], None))
        graph.replay()
        return rep


class FlaTarget(EagerTarget):
    """FLA-SD (SpecLA §8.1): the same drafts, verified by fla's `GatedDeltaNetForCausalLM`.

    Each root-to-leaf path runs from a copy of fla's cache (shared prefixes recomputed, as
    fla has no tree verification); the commit replays the accepted tokens through the model
    (token replay). Pure-GDN fla-format targets, batch 1.
    """

    def __init__(self, model: Model, batch: int, max_len: int):
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        from specla.checkpoint import _canonical_to_fla
        from specla.config import to_fla_dict

        if batch != 1:
            raise ValueError("the fla baseline runs at batch 1")
        self.model = model
        self.cache = None  # fla keeps its own cache; nothing of specla's state exists
        fla_cfg = GatedDeltaNetConfig(**{k: v for k, v in to_fla_dict(model.cfg).items()
                                         if k not in ("architectures", "model_type")})
        with torch.device("meta"):
            self.fla = GatedDeltaNetForCausalLM(fla_cfg)
        sd = _canonical_to_fla({k: v.detach() for k, v in model.state_dict().items()}, model.cfg)
        if model.cfg.tie_word_embeddings:
            sd["lm_head.weight"] = sd["model.embeddings.weight"]
        self.fla.load_state_dict(sd, assign=True)
        self.fla.eval()
        self.pkv = None
        self.tokens = None
        self.width = None  # no exact mode: fla's kernels are not ours
        self._emission(batch, model.device)

    @torch.no_grad()
    def _run(self, tokens, pkv, capture):
        out = self.fla(input_ids=tokens, past_key_values=pkv, use_cache=True,
                       output_hidden_states=bool(capture))
        hidden = {i: out.hidden_states[i + 1] for i in capture}
        return out, hidden

    def prefill(self, tokens, capture=(), logits: bool = True):
        # fla's model runs its LM head whatever is asked; its logits are returned either way
        out, hidden = self._run(tokens, self.pkv, capture)
        self.pkv = out.past_key_values
        return ModelOutput(out.logits, hidden)

    def step(self, root):
        out, _ = self._run(root[:, None], self.pkv, ())
        self.pkv = out.past_key_values
        return out.logits[:, -1]

    def verify(self, tokens, parents, capture=(), greedy=True, valid=None, chain=False):
        from specla.topology import root_to_leaf_paths

        n = tokens.shape[1]
        logits = torch.empty(1, n, self.model.cfg.vocab_size, device=tokens.device)
        hidden = {i: torch.empty(1, n, self.model.cfg.hidden_size, device=tokens.device, dtype=self.model.dtype)
                  for i in capture}  # what the drafter reads, in the model's dtype like every route's
        for path in root_to_leaf_paths(parents[0]):
            out, hid = self._run(tokens[:, path], copy.deepcopy(self.pkv), capture)
            logits[:, path] = out.logits.float()
            for i in capture:
                hidden[i][:, path] = hid[i].to(hidden[i].dtype)
        self.tokens = tokens
        acc = acceptance.greedy(tokens, parents, logits, valid) if greedy else None
        return ModelOutput(logits, hidden), acc

    def commit(self, records, path, length, delayed):
        n = int(length[0])
        if n:
            out, _ = self._run(self.tokens[:, path[0, :n]], self.pkv, ())
            self.pkv = out.past_key_values

    def flush(self) -> None:
        pass
