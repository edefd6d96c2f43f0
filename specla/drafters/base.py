"""The drafter interface: propose a topology from the context (DESIGN §5).

A drafter sees every row's token history (ending with the root, the last emitted token),
the target features it asked for (`capture`: hidden states of chosen target layers for every
consumed token, delivered through `extend`), and the target's cache (ReaDy reads its states).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from specla.state import Cache


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, n]; node 0 is the root token
    parents: torch.Tensor  # [B, n]; topological parent array, parents[:, 0] = -1
    # The distribution each node's token was drawn from ([B, n, V]); None: deterministic
    # proposals (point masses), e.g. top-k children. Only sampling acceptance reads it.
    probs: torch.Tensor | None = None
    # Real nodes per row ([B]; None: all n). Rows are padded to a common n; padded nodes are
    # verified but never accepted.
    valid: torch.Tensor | None = None
    # the tensors are a CUDA graph's outputs: the same storage every round, refreshed in place,
    # so the target's round graph may read them where they are (`GraphTarget.round`)
    static: bool = False

    @property
    def size(self) -> int:
        """Draft nodes (the root excluded), as sizes are quoted everywhere."""
        return self.tokens.shape[1] - 1


@dataclass
class DraftContext:
    # per row: prompt + emitted tokens; the last one is the root. None when the loop runs
    # ahead of the host (greedy on CUDA graphs): then only `root` is known, on the device
    history: list[list[int]] | None
    cache: Cache
    temperature: float = 0.0
    generator: torch.Generator | None = None
    extra: dict = field(default_factory=dict)
    root: torch.Tensor | None = None  # [B] the roots on the device (set with history None)


class Drafter:
    """Base class; subclasses implement `propose` and, if they read target features, `extend`."""

    name = "drafter"
    capture: tuple[int, ...] = ()  # target layers whose residual stream the drafter reads
    max_nodes: int = 64  # largest topology it proposes, root included (sizes CUDA-graph buffers)
    # longest root-to-leaf path it proposes, root included (None: max_nodes, a chain): a round
    # accepts at most this many nodes, which sizes the target's pending buffers
    _max_path: int | None = None
    # drafts from `DraftContext.root` alone (no host history, no host read): the decode loop
    # may then run rounds ahead of the host
    device_root: bool = False
    # every draft is a chain (node j's parent is j - 1): the target's attention layers may then
    # read keys in position order (`GatedAttention.verify`)
    chain: bool = False

    @property
    def max_path(self) -> int:
        return self.max_nodes if self._max_path is None else min(self._max_path, self.max_nodes)

    def reset(self, batch: int, horizon: int | None = None) -> None:
        """Start a new generation. horizon: the most tokens the target consumes in it (prompt
        plus new tokens; None: unknown), so a drafter's attention may span only that much of
        its cache (`attention_window`)."""

    def extend(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], length: torch.Tensor,
               static: bool = False) -> None:
        """The target consumed tokens[b, :length[b]] and produced these features for them.
        static: the tensors are a CUDA graph's outputs (`engine.Round.static`), refreshed in
        place every round: a graphed drafter may read them there instead of copying them."""

    def propose(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    def observe(self, accepted: list[int]) -> None:
        """The host read the report of this drafter's oldest unread proposal: each row's accepted
        draft tokens. Reports arrive in proposal order; in-flight rounds are reported later, and
        a generation's last may never be (`reset` forgets it)."""


def pad_drafts(rows: list[tuple[list[int], list[int]]], device=None) -> Draft:
    """Stack per-row (tokens, parents) of different sizes into one Draft, each row padded as
    `pad_draft` pads, on host lists (a host drafter calls it every round: one tensor per
    field, not a pad per row); `valid` tells acceptance to ignore the padding."""
    n = max(len(t) for t, _ in rows)
    toks = [t + [t[-1]] * (n - len(t)) for t, _ in rows]
    pars = [p + list(range(len(p) - 1, n - 1)) for _, p in rows]
    valid = None if all(len(t) == n for t, _ in rows) else torch.tensor([len(t) for t, _ in rows], device=device)
    return Draft(torch.tensor(toks, dtype=torch.long, device=device),
                 torch.tensor(pars, dtype=torch.long, device=device), valid=valid)


@functools.lru_cache(maxsize=None)
def _chain_parents(width: int, device: torch.device) -> torch.Tensor:
    """[-1, 0, 1, ..., width - 2]: node j's parent j - 1 (padding copies a slice of it, so a
    round launches no arange)."""
    return torch.arange(-1, width - 1, device=device)


def pad_draft(tokens, parents, valid, width: int, out=None):
    """A draft [B, n] padded to `width` nodes with a chain under its last node (its last token
    repeated, node j's parent j - 1), and its real node count [B] (acceptance ignores the
    padding): written into `out` = (tokens, parents, valid) buffers when given (the static
    buffers of a CUDA graph), else into new tensors."""
    B, n = tokens.shape
    if n > width:
        raise ValueError(f"draft of {n} nodes exceeds the verify width of {width}")
    dev = tokens.device
    if out is None:
        out = (torch.empty(B, width, dtype=tokens.dtype, device=dev),
               torch.empty(B, width, dtype=parents.dtype, device=dev), torch.empty(B, dtype=torch.long, device=dev))
    t, p, v = out
    t[:, :n].copy_(tokens)
    t[:, n:].copy_(tokens[:, -1:].expand(-1, width - n))
    p[:, :n].copy_(parents)
    p[:, n:].copy_(_chain_parents(width, dev)[n:])
    if valid is None:
        v.fill_(n)
    else:
        v.copy_(valid)
    return out


def kv_room(capacity: int, bound: int, extra: int, length: torch.Tensor) -> tuple[int, int | None]:
    """Room for `extra` more cache entries per row past `length` [B] (device).

    `bound` is a host-side upper bound of max(length), so the common case needs no host read;
    only when it says the cache may be full is the true maximum read. Returns (the new bound,
    the capacity to grow the cache to, or None when it fits): at least double, so growth (and
    the recapture of any graph over the cache) is rare.
    """
    if bound + extra <= capacity:
        return bound, None
    bound = int(length.max())
    if bound + extra <= capacity:
        return bound, None
    return bound, max(2 * capacity, bound + extra)


def grown(cache: torch.Tensor, capacity: int) -> torch.Tensor:
    """A [B, H, capacity, D] copy of a [B, H, T, D] cache, zero past T."""
    out = cache.new_zeros(*cache.shape[:2], capacity, cache.shape[3])
    out[:, :, :cache.shape[2]] = cache
    return out


MIN_WINDOW = 128


def attention_window(capacity: int, bound: int, extra: int, horizon: int | None = None) -> int:
    """How many leading cache slots a draft step attends over: a power of two (at least
    MIN_WINDOW, at most `capacity`) holding every committed entry and `extra` more.

    The committed length is at most min(bound, horizon) (both upper bounds of it). Attending
    over the whole capacity instead would make every draft step pay for the longest prompt a
    long-lived drafter has seen; powers of two keep the number of captured graphs small.
    """
    need = (bound if horizon is None else min(bound, horizon)) + extra
    return min(capacity, max(MIN_WINDOW, 1 << max(need - 1, 0).bit_length()))
