"""Test-double drafters: random topologies, oracle-guided or deliberately wrong proposals."""

from __future__ import annotations

import torch

from specla import acceptance
from specla.drafters.base import Draft, DraftContext, Drafter, pad_drafts

SHAPES = ("single", "deep_chain", "wide_star", "random_tree", "bushy")


def random_parents(kind: str, n: int, g: torch.Generator) -> list[int]:
    if kind == "single" or n == 1:
        return [-1]
    if kind == "deep_chain":
        return list(range(-1, n - 1))
    if kind == "wide_star":
        return [-1] + [0] * (n - 1)
    if kind == "bushy":  # complete-ish binary tree
        return [-1] + [(j - 1) // 2 for j in range(1, n)]
    return [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, n)]


class OracleTreeDrafter(Drafter):
    """Random topologies whose tokens follow a known continuation with probability `hit`.

    `oracle[b]` is row b's full AR continuation (prompt + generated). A node at depth d
    proposes oracle[pos + d] with probability `hit` (else a random other token), so rounds
    accept anything from nothing to a whole deep path; every fourth round misses on purpose.
    """

    name = "oracle-tree"

    def __init__(self, oracle: list[list[int]], vocab: int, max_nodes: int = 12, hit: float = 0.75, seed: int = 0,
                 shapes: tuple[str, ...] = SHAPES):
        self.oracle, self.vocab, self.max_nodes, self.hit, self.shapes = oracle, vocab, max_nodes, hit, shapes
        self.chain = shapes == ("deep_chain",)
        self.g = torch.Generator().manual_seed(seed)
        self.round = 0

    def propose(self, ctx: DraftContext) -> Draft:
        rows = []
        for b, hist in enumerate(ctx.history):
            kind = self.shapes[(self.round + b) % len(self.shapes)]
            n = int(torch.randint(1, self.max_nodes + 1, (1,), generator=self.g))
            par = random_parents(kind, n, self.g)
            depth = [0] * len(par)
            tok = [hist[-1]]
            hit = 0.0 if self.round % 4 == 3 else self.hit
            for j in range(1, len(par)):
                depth[j] = depth[par[j]] + 1
                pos = len(hist) - 1 + depth[j]
                want = self.oracle[b][pos] if pos < len(self.oracle[b]) else -1
                if float(torch.rand(1, generator=self.g)) < hit and want >= 0:
                    tok.append(want)
                else:
                    other = int(torch.randint(0, self.vocab - 1, (1,), generator=self.g))
                    tok.append(other + (other >= want >= 0))
            rows.append((tok, par))
        self.round += 1
        return pad_drafts(rows)


class SampledTreeDrafter(Drafter):
    """Stochastic drafts for the losslessness test: a fixed shape of `fanout` children per node.

    Children of a node are drawn i.i.d. from q, which is the target's own distribution at that
    node (computed by verifying the partial tree) for half the rows and a random Dirichlet
    distribution (wrong) for the other half; with `deterministic`, children are the top-k of q
    and reported as point masses.
    """

    name = "sampled-tree"

    def __init__(self, model, depth: int, fanout: int, temperature: float, top_p: float,
                 deterministic: bool = False, seed: int = 0):
        self.model, self.depth, self.fanout = model, depth, fanout
        self.temperature, self.top_p, self.deterministic = temperature, top_p, deterministic
        self.max_nodes = sum(fanout ** d for d in range(depth + 1))
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, ctx: DraftContext) -> Draft:
        B = len(ctx.history)
        V = self.model.cfg.vocab_size
        tokens = torch.tensor([[h[-1]] for h in ctx.history])
        parents = [-1]
        probs = [torch.zeros(B, V, dtype=torch.float64)]
        frontier = [0]
        wrong = torch.rand(B, generator=self.g) < 0.5
        for _ in range(self.depth):
            par_t = torch.tensor(parents).expand(B, -1)
            logits = self.model.verify(tokens, par_t, ctx.cache).logits
            new_frontier = []
            for node in frontier:
                q = acceptance.target_probs(logits[:, node], self.temperature, self.top_p)
                bad = torch.distributions.Dirichlet(torch.full((V,), 0.3, dtype=torch.float64)).sample((B,))
                q = torch.where(wrong[:, None], bad, q)
                if self.deterministic:
                    kids = q.topk(self.fanout, dim=-1).indices.T
                else:
                    kids = torch.multinomial(q, self.fanout, replacement=True, generator=self.g).T
                for kid in kids:
                    parents.append(node)
                    tokens = torch.cat([tokens, kid[:, None]], 1)
                    probs.append(q)
                    new_frontier.append(len(parents) - 1)
            frontier = new_frontier
        return Draft(tokens, torch.tensor(parents).expand(B, -1),
                     None if self.deterministic else torch.stack(probs, 1))


