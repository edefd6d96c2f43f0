"""Prompt-lookup (n-gram) drafter: continuations copied from earlier matches in the context.

Needs no training. The longest suffix n-gram (max_ngram down to min_ngram) that occurred
before is looked up; for a chain the most recent match's continuation is proposed; for a tree
the continuations of several matches are merged into a trie (most recent match first, so the
first child is the best-ranked one) and cut to the node budget in breadth-first order.
"""

from __future__ import annotations

from specla.drafters.base import Draft, DraftContext, Drafter, pad_drafts


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, length: int = 8, topk: int = 1, budget: int | None = None,
                 max_ngram: int = 4, min_ngram: int = 1):
        self.length = length
        self.topk = topk
        self.budget = budget if budget is not None else length * topk
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_nodes = self.budget + 1
        self.chain = topk == 1  # one continuation

    def continuations(self, hist: list[int]) -> list[list[int]]:
        for size in range(min(self.max_ngram, len(hist) - 1), self.min_ngram - 1, -1):
            pattern = hist[-size:]
            found, seen = [], set()
            for i in range(len(hist) - size - 1, -1, -1):  # most recent first
                if hist[i:i + size] == pattern:
                    cont = tuple(hist[i + size:i + size + self.length])
                    if cont and cont not in seen:
                        seen.add(cont)
                        found.append(list(cont))
                        if len(found) == self.topk:
                            break
            if found:
                return found
        return []

    def _trie(self, root: int, conts: list[list[int]]) -> tuple[list[int], list[int]]:
        # Build the trie, then number nodes breadth-first so the budget cut keeps ancestors.
        kids: dict[int, list[tuple[int, int]]] = {0: []}
        tok = [root]
        for cont in conts:
            node = 0
            for t in cont:
                nxt = next((c for tt, c in kids[node] if tt == t), None)
                if nxt is None:
                    nxt = len(tok)
                    tok.append(t)
                    kids[nxt] = []
                    kids[node].append((t, nxt))
                node = nxt
        order, par, queue = [0], [-1], [0]
        new_id = {0: 0}
        while queue and len(order) < self.budget + 1:
            node = queue.pop(0)
            for _, c in kids[node]:
                if len(order) == self.budget + 1:
                    break
                new_id[c] = len(order)
                order.append(c)
                par.append(new_id[node])
                queue.append(c)
        return [tok[i] for i in order], par

    def propose(self, ctx: DraftContext) -> Draft:
        rows = [self._trie(h[-1], self.continuations(h)) for h in ctx.history]
        return pad_drafts(rows)
