"""Acceptance: which verified nodes become output (DESIGN §4).

Both rules walk the topology from the root and return the accepted path (root first), its
length and the token emitted after it. They are vectorised over the batch: nodes are visited
once in topological order, and a row moves to node j only if j is a child of the row's
current node, so children are tried in index order and a node's subtree after the node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specla import ops
from specla.ops.beam.naive import first_max


@dataclass
class Acceptance:
    path: torch.Tensor  # [B, n] accepted node ids, root first, padded with 0
    length: torch.Tensor  # [B] nodes on the path (accepted drafts + 1)
    bonus: torch.Tensor  # [B] the token emitted after the path (target's own choice)
    top: torch.Tensor | None = None  # [B] the target's argmax at the root, when the rule computed it

    @property
    def accepted(self) -> torch.Tensor:
        return self.length - 1


def _live(valid, B, n, device) -> torch.Tensor:
    """[B, n] mask of real nodes; padding (index >= valid[b]) is never accepted."""
    idx = torch.arange(n, device=device).expand(B, n)
    return idx < valid[:, None] if valid is not None else torch.ones(B, n, dtype=torch.bool, device=device)


def greedy(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
           valid: torch.Tensor | None = None) -> Acceptance:
    """Follow the child whose token is the target's argmax (lowest id on ties, as AR)."""
    target = first_max(logits)[1]
    path, length, last = ops.greedy_walk(tokens, parents, target, valid)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return Acceptance(path, length, target[rows, last], target[:, 0])


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution AR sampling draws from: softmax(logits / T), then nucleus (top-p) filtering."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sp, idx = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sp.cumsum(-1) - sp) < top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, draft_probs: torch.Tensor | None,
           temperature: float, top_p: float, generator: torch.Generator | None = None,
           valid: torch.Tensor | None = None) -> Acceptance:
    """Lossless acceptance for chains and trees: recursive rejection sampling over siblings.

    `draft_probs[b, j]` is the distribution node j's token was drawn from, given its parent's
    path and its earlier siblings; None means every node is a deterministic proposal (point
    mass), e.g. top-k children. At the current node with residual target r, child c with
    token x is accepted with probability min(1, r(x) / q_c(x)); on rejection
    r <- norm(max(r - q_c, 0)). After the last try the emitted token is drawn from r. For a
    chain this is Leviathan / Chen rejection sampling; the output is distributed exactly as
    the target's (SpecInfer's multi-draft argument, one child at a time).
    """
    B, n = tokens.shape
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    live = _live(valid, B, n, dev)
    p = target_probs(logits, temperature, top_p)  # [B, n, V] float64
    resid = p[:, 0].clone()
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.zeros(B, n, dtype=torch.long, device=dev)
    length = torch.ones(B, dtype=torch.long, device=dev)
    u = torch.rand(B, n, generator=generator, device=dev, dtype=torch.float64)
    for j in range(1, n):
        cand = (parents[:, j] == cur) & live[:, j]
        x = tokens[:, j]
        if draft_probs is None:
            q = torch.nn.functional.one_hot(x, p.shape[-1]).double()
        else:
            q = draft_probs[:, j].double()
        rx, qx = resid[rows, x], q[rows, x]
        accept = cand & (u[:, j] * qx < rx)  # u < r(x)/q(x) without dividing by a zero q(x)
        reject = cand & ~accept
        left = (resid - q).clamp(min=0)
        mass = left.sum(-1, keepdim=True)
        # r == q can only be rejected with probability 0; keep r then rather than divide by 0
        left = torch.where(mass > 0, left / mass.clamp(min=1e-300), resid)
        resid = torch.where(reject[:, None], left, torch.where(accept[:, None], p[:, j], resid))
        slot = length.clamp(max=n - 1)
        path[rows, slot] = torch.where(accept, j, path[rows, slot])
        length = length + accept.long()
        cur = torch.where(accept, j, cur)
    bonus = torch.multinomial(resid, 1, generator=generator)
    return Acceptance(path, length, bonus.squeeze(1))


# emission: what a round hands to the output ---------------------------------------------------

REPORT_HEAD = 6  # report columns before the tokens: count, length, first, top, drafted, done


def emit(path_tokens: torch.Tensor, acc: Acceptance, emitted: torch.Tensor, done: torch.Tensor,
         room: torch.Tensor, eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's output on the device, by the decode loop's rule: the accepted drafts, then the
    bonus token, cut through the first EOS and at the row's remaining room; rows already done
    emit nothing. path_tokens [B, W] (root first, `acc.path`'s tokens); emitted, done, room [B]
    (done and emitted are updated in place); eos [E] (ids; -1 pads a fixed-size buffer).
    Returns (tokens [B, W], of which row b emits the first count[b]; count [B]) — count is
    also what the commit consumes: the root and the first count - 1 accepted drafts."""
    B, W = path_tokens.shape
    j = torch.arange(W, device=path_tokens.device)
    toks = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], 1)
    toks = torch.where(j == (acc.length - 1)[:, None], acc.bonus[:, None], toks)
    is_eos = (toks[..., None] == eos).any(-1) & (j < acc.length[:, None])
    first_eos = torch.where(is_eos, j, W).amin(1)
    count = torch.minimum(torch.minimum(acc.length, first_eos + 1), (room - emitted).clamp(min=0))
    count = torch.where(done, 0, count)
    emitted += count
    done |= (first_eos < count) | (emitted >= room)
    return toks, count


def report(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor | None, logits: torch.Tensor,
           acc: Acceptance, toks: torch.Tensor, count: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """Everything the host reads of a round, in one [B, REPORT_HEAD + W] tensor (one copy):
    count, path length, the root's first child's token (-1 if none: drafters put their best
    child first), the target's greedy token at the root (-1 without drafts), real draft
    nodes, done; then the emitted tokens."""
    B, n = tokens.shape
    first = top = torch.full_like(count, -1)  # no draft (an AR step): no match to report
    if n > 1:
        real = parents[:, 1] == 0
        if valid is not None:
            real = real & (valid > 1)
        first = torch.where(real, tokens[:, 1], first)
        top = acc.top if acc.top is not None else first_max(logits[:, 0])[1]
    drafted = (valid if valid is not None else torch.full_like(count, n)) - 1
    head = [count, acc.length, first, top, drafted, done.long()]
    return torch.cat([torch.stack(head, 1), toks], 1)
