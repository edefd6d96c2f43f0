"""The pipelined decode loop, emulated on CPU.

Greedy decoding on CUDA graphs lets the device settle every round (`acceptance.emit`: what is
emitted, cut at EOS and at the token budget, and committed) so the host reads round r while
round r + 1 runs. Graphs are emulated (`graph_emulation`); the loop must emit exactly what the
read-every-round loop emits — tokens, stop reason, per-round statistics — and leave the same
state.
"""

from __future__ import annotations

import random

import pytest
import torch

from specla import acceptance
from specla.api import DEMO_DIR
from specla.checkpoint import load_model
from specla.decode import Decoder
from specla.drafters.eagle import EagleDrafter, find_drafter, load_drafter

from conftest import random_model, tiny_config
from graph_emulation import emulate_graphs
from test_exactness import assert_same_state


@pytest.fixture
def emulated(monkeypatch):
    emulate_graphs(monkeypatch)


def _host_count(toks: list[int], room: int, eos: set[int]) -> int:
    """The rule, as the host loop applied it before the device did."""
    for i, t in enumerate(toks[:room]):
        if t in eos:
            return i + 1
    return min(len(toks), room)


def test_emit_is_the_host_rule():
    """`acceptance.emit` on random paths, lengths, EOS sets, budgets and done rows: the same
    tokens and counts as the host rule, and the same done flags."""
    rng = random.Random(0)
    for _ in range(200):
        B, W, V = rng.randint(1, 4), rng.randint(1, 9), 12
        path_tokens = torch.randint(0, V, (B, W), generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        length = torch.tensor([rng.randint(1, W) for _ in range(B)])
        bonus = torch.randint(0, V, (B,))
        eos_ids = set(rng.sample(range(V), rng.randint(0, 3)))
        eos = torch.tensor(sorted(eos_ids) + [-1] * (4 - len(eos_ids)))
        room = torch.tensor([rng.randint(1, 12) for _ in range(B)])
        emitted = torch.tensor([rng.randint(0, int(r)) for r in room])
        done = torch.tensor([rng.random() < 0.2 for _ in range(B)])
        acc = acceptance.Acceptance(torch.zeros(B, W, dtype=torch.long), length, bonus)
        want = []
        for b in range(B):
            toks = path_tokens[b, 1:int(length[b])].tolist() + [int(bonus[b])]
            r = 0 if done[b] else _host_count(toks, int(room[b] - emitted[b]), eos_ids)
            new = toks[:r]
            ended = bool(done[b]) or (bool(new) and new[-1] in eos_ids) or int(emitted[b]) + r >= int(room[b])
            want.append((new, r, int(emitted[b]) + r, ended))
        e, d = emitted.clone(), done.clone()
        toks, count = acceptance.emit(path_tokens, acc, e, d, room, eos)
        for b, (new, r, em, ended) in enumerate(want):
            assert int(count[b]) == r and toks[b, :r].tolist() == new
            assert int(e[b]) == em and bool(d[b]) == ended


def _eos_at(tokens: list[int], k: int) -> set[int]:
    """An EOS id that first occurs at index k of tokens (some later index if that one repeats)."""
    for j in range(k, len(tokens)):
        if tokens[j] not in tokens[:j]:
            return {tokens[j]}
    raise AssertionError("no fresh token to stop at")


def _check(model, make_drafter, route, prompt, new, eos=frozenset()):
    """Pipelined == host loop on the same graphs: tokens, stop reason, statistics, state."""
    runs = {}
    for pipeline in (True, False):
        dec = Decoder(model, make_drafter(), route, graphs=True, pipeline=pipeline, eos_token_ids=set(eos))
        runs[pipeline] = dec.run(torch.tensor([prompt]), new)
        (target,) = dec.targets.values()
        assert {"round", "ar_round"} & {k if isinstance(k, str) else k[0] for k in target.graphs}
        assert dec._runs_ahead(target) == pipeline
    (rows_p, res_p, cache_p), (rows_h, res_h, cache_h) = runs[True], runs[False]
    assert rows_p == rows_h
    assert res_p.stop_reason == res_h.stop_reason
    assert [(r.drafted, r.accepted, r.emitted, r.first_token_match) for r in res_p.rounds] == \
           [(r.drafted, r.accepted, r.emitted, r.first_token_match) for r in res_h.rounds]
    return rows_p, res_p, cache_p, cache_h


def test_pipelined_ar_equals_host_loop(emulated):
    cfg = tiny_config(2)
    model = random_model(cfg, 2)
    prompt = list(range(3, 13))
    eager = Decoder(model, graphs=False).run(torch.tensor([prompt]), 24)[0][0]
    rows, res, _, _ = _check(model, lambda: None, "ar", prompt, 24)
    assert rows[0] == eager and res.stop_reason == "max_new_tokens" and len(res.rounds) == 24
    eos = _eos_at(eager, 9)
    rows, res, _, _ = _check(model, lambda: None, "ar", prompt, 24, eos)
    assert rows[0] == eager[:eager.index(next(iter(eos))) + 1] and res.stop_reason == "eos"


@pytest.fixture(scope="module")
def demo_fp32():
    model = load_model(DEMO_DIR, dtype=torch.float32)
    return model, load_drafter(find_drafter(DEMO_DIR), model, dtype=torch.float32)


@pytest.mark.parametrize("route,opts", [("chain", dict(topk=1, depth=8)),
                                        ("tree", dict(topk=4, depth=6, budget=16))])
def test_pipelined_eagle_equals_host_loop(emulated, demo_fp32, route, opts):
    """The trained demo pair (real acceptance: multi-token rounds), fp32: the pipelined loop
    equals AR and the host loop, leaves the host loop's state after a budget stop and an EOS
    stop (commits cut inside an accepted path), and reuses its graphs across generations."""
    model, dm = demo_fp32

    def make():
        d = EagleDrafter(dm, model, **opts)
        d.graphs = True  # CUDA graphs in name: the emulation runs them on CPU
        return d

    prompt = [int(t) for t in torch.randint(3, 8000, (12,), generator=torch.Generator().manual_seed(1))]
    ar = Decoder(model, graphs=False).run(torch.tensor([prompt]), 40)[0][0]
    rows, res, cache_p, cache_h = _check(model, make, route, prompt, 40)
    assert rows[0] == ar and res.mean_accepted_length > 1.5
    assert_same_state(cache_p, cache_h, tol=1e-5)
    rows, res, cache_p, cache_h = _check(model, make, route, prompt, 40, _eos_at(ar, 17))
    assert res.stop_reason == "eos" and rows[0] == ar[:len(rows[0])] and len(rows[0]) < 40
    assert_same_state(cache_p, cache_h, tol=1e-5)


@pytest.mark.parametrize("route,threshold", [("dspark", 0.0), ("ready", 0.0), ("ready", 0.3)])
def test_pipelined_block_drafters_equal_host_loop(emulated, demo_fp32, route, threshold):
    """DSpark and ReaDy draft from the device root too (whole blocks, positions past the
    confidence cut marked invalid): the pipelined loop equals AR and the host loop, and ReaDy's
    reader, which flushes the pending commit it reads, leaves the same state."""
    from specla.drafters.blocks import block_drafter, find_block_drafter

    model, _ = demo_fp32
    loaded = block_drafter(find_block_drafter(DEMO_DIR, route), model, threshold=threshold)
    cls = type(loaded)

    def make():
        d = cls(loaded.model, model, threshold=threshold)
        d.graphs = True
        return d

    prompt = [int(t) for t in torch.randint(3, 8000, (12,), generator=torch.Generator().manual_seed(2))]
    ar = Decoder(model, graphs=False).run(torch.tensor([prompt]), 32)[0][0]
    rows, res, cache_p, cache_h = _check(model, make, route, prompt, 32, _eos_at(ar, 9))
    assert rows[0] == ar[:len(rows[0])] and res.stop_reason == "eos"
    assert_same_state(cache_p, cache_h, tol=1e-5)


@pytest.mark.parametrize("pipeline,lag", [(True, 2), (False, 1)])
def test_adaptive_depth_reads_the_reports_the_host_has(emulated, demo_fp32, pipeline, lag):
    """A tree whose depth follows the reports (`tree.DepthPolicy`) on graphs, the demo pair in
    fp32: AR's tokens, and each round's depth is the policy's choice from the report of the
    round `lag` before it — two when the loop runs ahead (round r + 1 is queued before round r
    is read), one when the host reads every round."""
    model, dm = demo_fp32
    d = EagleDrafter(dm, model, topk=4, depth=(3, 6), budget=16)
    d.graphs = True
    used, choose = [], d._round_depth
    d._round_depth = lambda: used.append(choose()) or used[-1]
    prompt = [int(t) for t in torch.randint(3, 8000, (12,), generator=torch.Generator().manual_seed(1))]
    ar = Decoder(model, graphs=False).run(torch.tensor([prompt]), 40)[0][0]
    dec = Decoder(model, d, "tree", graphs=True, pipeline=pipeline)
    rows, res, _ = dec.run(torch.tensor([prompt]), 40)
    assert rows[0] == ar
    acc = [r.accepted for r in res.rounds]
    assert used[:len(acc)] == [d.policy.choose(acc[i - lag] if i >= lag else None) for i in range(len(acc))]
    assert set(used) == {3, 6}
    assert {k[1] for k in d._graphs} == {3, 6}
    # both depths write one set of drafts: the target keeps a round graph a window, not a depth
    (target,) = dec.targets.values()
    rounds = [k for k in target.graphs if isinstance(k, tuple) and k[0] == "round"]
    assert len(rounds) == len({k[0] for k in d._graphs})
