"""The CUDA-graph decode path, emulated on CPU: `GraphTarget`'s static buffers, padded
topologies, `valid` counts, one target shared by drafters that capture different layers, and
the Triton kernels' in-capture dispatch (plans built as inside a capture: no host reads of the
topology, hybrid schedules computed on the device), all under TRITON_INTERPRET=1 in fp32.

Graphs are emulated (`graph_emulation`): a replay re-runs the captured function into the
outputs the capture returned.
"""

from __future__ import annotations

import pytest
import torch

from specla import ops
from specla.decode import Decoder
from specla.drafters.ngram import NgramDrafter
from specla.engine import GraphTarget
from specla.ops.gdn import schedule

from conftest import random_model, tiny_config
from drafters import OracleTreeDrafter
from graph_emulation import captured, emulate_graphs


@pytest.fixture
def graph_path(monkeypatch):
    real_plan_for = schedule.plan_for

    def plan_for(parents):
        if not captured():
            return real_plan_for(parents)
        plan = getattr(parents, "_specla_plan", None)
        if plan is None or plan.version != parents._version or not plan.captured:
            plan = schedule.Plan(parents._version, True)
            parents._specla_plan = plan
        return plan

    monkeypatch.setattr(schedule, "plan_for", plan_for)
    emulate_graphs(monkeypatch)
    with ops.backend("triton"):
        yield


class FeatureReadingOracle(OracleTreeDrafter):
    """Reads a target layer's features, so its verify graph differs from the n-gram drafter's
    on the same shared target (as the EAGLE drafter's does)."""

    capture = (0,)


class ShallowOracle(OracleTreeDrafter):
    """Bushy trees and stars of up to 10 nodes: no path is longer than 4 nodes, which it
    declares (`Drafter.max_path`), so the target keeps 4-node pending buffers."""

    _max_path = 4

    def __init__(self, oracle, vocab, seed):
        super().__init__(oracle, vocab, max_nodes=10, seed=seed, shapes=("bushy", "wide_star"))


def _prompt(vocab, seed, length=10):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (length,), generator=g).tolist()
    return base + base[: length // 2]


def test_graph_path_equals_ar(graph_path):
    seed = 0  # GVA, short conv, gate: the interpreter makes every seed cost about a minute
    cfg = tiny_config(seed, num_hidden_layers=2)
    model = random_model(cfg, seed, dtype=torch.float32)
    prompt = _prompt(cfg.vocab_size, seed)
    new = 16
    ar = Decoder(model, graphs=False).run(torch.tensor([prompt]), new)[0]
    oracle = [prompt + ar[0]]
    targets: dict = {}  # shared, as `specla.api` shares them: routes of one budget share a target
    for delayed in (True,):
        for make in (lambda: NgramDrafter(length=4, topk=3, budget=9),
                     lambda: FeatureReadingOracle(oracle, cfg.vocab_size, max_nodes=10, seed=seed),
                     lambda: ShallowOracle(oracle, cfg.vocab_size, seed),
                     lambda: NgramDrafter(length=9, topk=1)):
            rows, res, _ = Decoder(model, make(), "tree", graphs=True, delayed=delayed,
                                   targets=targets).run(torch.tensor([prompt]), new)
            assert rows == ar, (make().name, delayed)
    assert any(isinstance(t, GraphTarget) for t in targets.values())
    shallow = [t for k, t in targets.items() if k[-1] == 4]
    assert len(shallow) == 1 and shallow[0].cache.bank.nodes == 4


def test_graph_prefill_equals_the_plain_forward(graph_path, monkeypatch):
    """`GraphTarget.prefill` (padded chains verified and committed in one graph each; three
    chunks here, the last partial) gives the plain forward's logits and captured features and
    leaves its state, on an AR target and on one with delayed commits; `SPECLA_PREFILL=plain`
    takes the plain forward itself."""
    from specla import engine

    monkeypatch.setattr(engine, "PREFILL_WIDTH", 4)
    cfg = tiny_config(3, num_hidden_layers=2, use_short_conv=True)
    model = random_model(cfg, 3, dtype=torch.float32)
    prompt = torch.tensor([_prompt(cfg.vocab_size, 3, length=7)])  # 10 tokens
    ref_cache = model.new_cache(1, max_len=64)
    ref = model.forward(prompt, ref_cache, capture=(0,))
    for budget, delayed in ((1, False), (9, True)):
        target = GraphTarget(model, 1, 64, budget, delayed)
        out = target.prefill(prompt, capture=(0,))
        assert ("prefill", "chain", 4, (0,), True) in target.graphs
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.hidden[0], ref.hidden[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(target.cache.length, ref_cache.length)
        for got, want in zip(target.cache.layers, ref_cache.layers):
            torch.testing.assert_close(got.S, want.S, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.conv, want.conv, rtol=1e-5, atol=1e-5)
            assert got.pending is None or int(got.pending[3].sum()) == 0
    monkeypatch.setattr(engine, "PREFILL", "plain")
    target = GraphTarget(model, 1, 64, 1, False)
    target.prefill(prompt)
    assert not target.graphs


def test_prefill_mode_switches_at_the_measured_crossover(monkeypatch):
    """Chains below engine.SEQUENCE_FROM tokens, padded sequences from there (the H200's
    crossover, bench prefill); a hybrid cache too short for a sequence's padding takes chains,
    one too short for those the plain forward; SPECLA_PREFILL=plain always the plain forward."""
    from specla import engine
    from specla.config import ATTENTION, GDN

    S = engine.SEQUENCE_FROM
    target = GraphTarget(random_model(tiny_config(6, num_hidden_layers=2), 6), 1, 64, 1, False)
    assert [target.prefill_mode(T) for T in (1, S - 1, S, 4096)] == ["chain", "chain", "sequence", "sequence"]
    over = dict(layer_types=[GDN, ATTENTION], attn_num_heads=2, attn_num_kv_heads=1, attn_head_dim=8)
    hybrid = random_model(tiny_config(6, num_hidden_layers=2, **over), 6)
    def padded(T, mode):
        return sum(w for _, w in engine.prefill_chunks(T, mode))

    T = next(t for t in range(S, 4096) if padded(t, "sequence") > padded(t, "chain"))  # a sequence pads more
    assert GraphTarget(hybrid, 1, padded(T, "sequence"), 1, False).prefill_mode(T) == "sequence"
    assert GraphTarget(hybrid, 1, padded(T, "sequence") - 1, 1, False).prefill_mode(T) == "chain"
    assert GraphTarget(hybrid, 1, S + 1, 1, False).prefill_mode(S + 2) == "plain"
    assert target.prefill_mode(S, "chain") == "chain" and target.prefill_mode(1, "sequence") == "sequence"
    monkeypatch.setattr(engine, "PREFILL", "plain")
    assert target.prefill_mode(S) == target.prefill_mode(1) == "plain"


@pytest.mark.parametrize("hybrid", [False, True])
def test_long_prompt_graph_prefill_equals_the_plain_forward(monkeypatch, hybrid):
    """From engine.SEQUENCE_FROM tokens on, `GraphTarget.prefill` replays plain sequences of
    engine.SEQUENCE_WIDTHS tokens, the last one padded and masked by `valid` (4 + 4 + 2 tokens,
    the last in a 2-token chunk, here, after a first prompt so the chunks start mid-cache): logits, features, GDN and conv
    states, K/V and the length equal the plain forward's. A prompt whose padding would overrun
    the K/V caches goes as chains instead, or plain where chains would overrun them too."""
    from specla import engine
    from specla.config import ATTENTION, GDN

    emulate_graphs(monkeypatch)
    monkeypatch.setattr(engine, "SEQUENCE_WIDTHS", (2, 4))
    monkeypatch.setattr(engine, "SEQUENCE_FROM", 4)
    over = dict(layer_types=[GDN, ATTENTION], attn_num_heads=2, attn_num_kv_heads=1, attn_head_dim=8) if hybrid else {}
    cfg = tiny_config(5, num_hidden_layers=2, use_short_conv=True, **over)
    model = random_model(cfg, 5, dtype=torch.float64)
    first = torch.tensor([_prompt(cfg.vocab_size, 1, length=4)])  # 6 tokens
    prompt = torch.tensor([_prompt(cfg.vocab_size, 2, length=7)])  # 10 tokens
    ref_cache = model.new_cache(1, max_len=64)
    model.forward(first, ref_cache)
    ref = model.forward(prompt, ref_cache, capture=(0,))
    # logits=False (the decode loop's prefill): no LM head, the same features and state
    for budget, delayed, logits in ((1, False, True), (9, True, True), (9, True, False)):
        target = GraphTarget(model, 1, 64, budget, delayed)
        target.prefill(first, logits=logits)
        out = target.prefill(prompt, capture=(0,), logits=logits)
        assert {k for k in target.graphs if k[0] == "prefill"} >= {("prefill", "sequence", w, (0,), logits)
                                                                    for w in (2, 4)}
        if logits:
            torch.testing.assert_close(out.logits, ref.logits, rtol=1e-10, atol=1e-10)
        else:
            assert out.logits is None
        torch.testing.assert_close(out.hidden[0], ref.hidden[0], rtol=1e-10, atol=1e-10)
        assert torch.equal(target.cache.length, ref_cache.length)
        for got, want in zip(target.cache.layers, ref_cache.layers):
            if isinstance(want, engine.GDNLayerState):
                torch.testing.assert_close(got.S, want.S, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(got.conv, want.conv, rtol=1e-10, atol=1e-10)
            else:  # the padding's K/V lie past the length, where the next tokens write
                n = int(ref_cache.length)
                torch.testing.assert_close(got.k[:, :, :n], want.k[:, :, :n], rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(got.v[:, :, :n], want.v[:, :, :n], rtol=1e-10, atol=1e-10)
    if hybrid:  # 9 + 12 padded positions overrun a 20-slot cache: chains, as the plain forward
        with monkeypatch.context() as m:  # 2-token chains fit where 4-token sequences do not
            m.setattr(engine, "PREFILL_WIDTH", 2)
            m.setattr(engine, "SEQUENCE_WIDTHS", (4,))
            target = GraphTarget(model, 1, 20, 1, False)
            target.prefill(torch.tensor([_prompt(cfg.vocab_size, 3, length=6)]))
            ref_cache = model.new_cache(1, max_len=20)
            model.forward(torch.tensor([_prompt(cfg.vocab_size, 3, length=6)]), ref_cache)
            assert target.prefill_mode(prompt.shape[1]) == "chain"
            out = target.prefill(prompt, capture=(0,))
            assert ("prefill", "sequence", 4, (), True) in target.graphs
            assert ("prefill", "sequence", 4, (0,), True) not in target.graphs
            assert ("prefill", "chain", engine.PREFILL_WIDTH, (0,), True) in target.graphs
            torch.testing.assert_close(out.logits, model.forward(prompt, ref_cache).logits, rtol=1e-10, atol=1e-10)
            assert int(target.cache.length) == 19
            target = GraphTarget(model, 1, 20, 1, False)  # 9 + 11 tokens in 2-token chunks need 21 slots: plain
            target.prefill(torch.tensor([_prompt(cfg.vocab_size, 3, length=6)]))
            assert target.prefill_mode(11) == "plain"
    # a sparse MoE layer whose grouped path would read expert ids on the host: no graph
    moe = random_model(tiny_config(5, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=8), 5, dtype=torch.float64)
    target = GraphTarget(moe, 1, 64, 1, False)
    ref_cache = moe.new_cache(1, max_len=64)
    torch.testing.assert_close(target.prefill(prompt).logits, moe.forward(prompt, ref_cache).logits)
    monkeypatch.setattr(ops, "CHUNK_MIN_TOKENS", 512)  # a 32-token chain's verify groups too
    torch.testing.assert_close(target.prefill(prompt).logits, moe.forward(prompt, ref_cache).logits)
    assert not any(k[0] == "prefill" for k in target.graphs)
