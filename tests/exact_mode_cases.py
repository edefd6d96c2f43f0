"""Exact mode in bf16 on CPU: every route emits AR's tokens bit for bit, not just in float64.

In exact mode every target call verifies the same number of nodes (AR steps verify the root
alone), and a commit applies its factors with the verifier's own update, so each position's
logits are computed by the same arithmetic on every route and the committed states agree bit
for bit. Random bf16 weights have near-ties everywhere, so any rounding difference shows.

These cases need torch's portable CPU kernels (ATEN_CPU_CAPABILITY=default, read when torch is
imported: the vectorised ones round a loop's tail elements differently, docs/exact.md), so
`test_exact_mode.py` runs them in a child process: `python exact_mode_cases.py CASE`.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from specla import ops  # noqa: E402
from specla.fused import fuse  # noqa: E402
from specla.decode import Decoder  # noqa: E402
from specla.drafters.ngram import NgramDrafter  # noqa: E402
from specla.state import GDNLayerState  # noqa: E402

from conftest import random_model, tiny_config  # noqa: E402
from drafters import OracleTreeDrafter  # noqa: E402
from graph_emulation import emulate_graphs  # noqa: E402
from test_exactness import make_prompt  # noqa: E402

NEW = 48
INTERPRETED_NEW = 16  # the Triton interpreter's cases: ~1 s a round on a 2-core CI machine
WIDTH = 13


def assert_bitwise_state(a, b):
    assert torch.equal(a.length, b.length)
    n = int(a.length.max())
    for sa, sb in zip(a.layers, b.layers):
        if isinstance(sa, GDNLayerState):
            assert torch.equal(sa.S, sb.S)
            if sa.conv is not None:
                assert torch.equal(sa.conv, sb.conv)
        else:  # attention: the committed K/V entries
            assert torch.equal(sa.k[:, :, :n], sb.k[:, :, :n]) and torch.equal(sa.v[:, :, :n], sb.v[:, :, :n])


def _routes(oracle, cfg, seed):
    return [
        ("chain", lambda: NgramDrafter(length=8, topk=1)),
        ("tree", lambda: NgramDrafter(length=4, topk=3, budget=10)),
        ("tree", lambda: OracleTreeDrafter(oracle, cfg.vocab_size, max_nodes=WIDTH, seed=seed)),
    ]


def routes_equal_ar_bitwise_in_bf16(seed):
    cfg = tiny_config(seed, vocab_size=256)
    model = random_model(cfg, seed, dtype=torch.bfloat16)
    prompt = make_prompt(cfg, seed, 6 + seed % 9)
    ar_rows, _, ar_cache = Decoder(model, exact_width=WIDTH).run(torch.tensor([prompt]), NEW)
    oracle = [prompt + ar_rows[0]]
    multi = 0
    for route, make in _routes(oracle, cfg, seed):
        for delayed in (True, False):
            rows, res, cache = Decoder(model, make(), route, delayed=delayed, exact_width=WIDTH).run(
                torch.tensor([prompt]), NEW)
            assert rows == ar_rows, (route, delayed)
            assert_bitwise_state(cache, ar_cache)
            multi += sum(r.accepted > 0 for r in res.rounds)
    assert multi > 0  # rounds that accepted drafts: positions past the root were compared


def without_exact_mode_states_differ():
    """Without exact mode the same bf16 runs do not end in AR's state bit for bit (the verify
    and the sequence path round differently): the bitwise checks above have something to catch."""
    differs = 0
    for seed in range(4):
        cfg = tiny_config(seed, vocab_size=256)
        model = random_model(cfg, seed, dtype=torch.bfloat16)
        prompt = make_prompt(cfg, seed, 8)
        _, _, ar_cache = Decoder(model).run(torch.tensor([prompt]), NEW)
        _, _, cache = Decoder(model, NgramDrafter(length=8, topk=1), "chain").run(torch.tensor([prompt]), NEW)
        try:
            assert_bitwise_state(cache, ar_cache)
        except AssertionError:
            differs += 1
    assert differs > 0


def triton_kernels_and_graphs(seed):
    """The Triton verifier and commit (interpreter) on emulated CUDA graphs: AR through the
    round graph, chains and trees through the same graph, identical tokens and states."""
    with pytest.MonkeyPatch.context() as mp:
        emulate_graphs(mp)
        _triton_kernels_and_graphs(seed)


def _triton_kernels_and_graphs(seed):
    cfg = tiny_config(seed, vocab_size=256, num_hidden_layers=2)
    model = random_model(cfg, seed, dtype=torch.bfloat16)
    prompt = make_prompt(cfg, seed, 8)
    with ops.backend("triton"):
        ar = Decoder(model, graphs=True, exact_width=WIDTH)
        ar_rows, _, ar_cache = ar.run(torch.tensor([prompt]), INTERPRETED_NEW)
        (target,) = ar.targets.values()
        assert ("round", (), True) in target.graphs and "ar_round" not in target.graphs
        oracle = [prompt + ar_rows[0]]
        for route, make in _routes(oracle, cfg, seed)[1:]:
            rows, _, cache = Decoder(model, make(), route, graphs=True, exact_width=WIDTH).run(
                torch.tensor([prompt]), INTERPRETED_NEW)
            assert rows == ar_rows, route
            assert_bitwise_state(cache, ar_cache)


def hybrid_chains(seed):
    """A dense hybrid target (GDN + softmax attention): chain routes (n-gram, an oracle that
    drafts chains with long and empty acceptances) equal exact-mode AR bit for bit, K/V
    caches included: a chain's attention reads its keys in position order, as AR does."""
    cfg = tiny_config(seed, vocab_size=256, num_hidden_layers=3, attn_num_heads=2, attn_num_kv_heads=1,
                      attn_head_dim=8, layer_types=["linear_attention", "full_attention", "linear_attention"])
    model = random_model(cfg, seed, dtype=torch.bfloat16)
    prompt = make_prompt(cfg, seed, 6 + seed % 5)
    ar_rows, _, ar_cache = Decoder(model, exact_width=WIDTH).run(torch.tensor([prompt]), NEW)
    oracle = [prompt + ar_rows[0]]
    accepted = 0
    for make in (lambda: NgramDrafter(length=8, topk=1),
                 lambda: OracleTreeDrafter(oracle, cfg.vocab_size, max_nodes=WIDTH, seed=seed, shapes=("deep_chain",))):
        for delayed in (True, False):
            rows, res, cache = Decoder(model, make(), "chain", delayed=delayed, exact_width=WIDTH).run(
                torch.tensor([prompt]), NEW)
            assert rows == ar_rows, delayed
            assert_bitwise_state(cache, ar_cache)
            accepted += sum(r.accepted for r in res.rounds)
    assert accepted > 0


def default_chains_equal_ar(seed):
    """Without exact mode: through the fused path with row-invariant products
    (`gemv="invariant"`) and the Triton kernels (interpreter), fp32, chain routes (n-gram
    chains; an oracle drafting chains with long and empty acceptances) verify at their own width
    and still emit AR's tokens and end in its GDN and conv states bit for bit, delayed commits
    and immediate: an AR step computes a position as a verify's row does (docs/exact.md).
    fp32, because the interpreter's bf16 `tl.dot` is broken (test_linear_kernels.py); the state
    check is bitwise either way."""
    cfg = tiny_config(seed, vocab_size=256, num_hidden_layers=2)
    model = random_model(cfg, seed, dtype=torch.float32)
    fuse(model, mode="default", compile=False, gemv="invariant")
    prompt = make_prompt(cfg, seed, 8)
    with ops.backend("triton"):
        ar_rows, _, ar_cache = Decoder(model).run(torch.tensor([prompt]), INTERPRETED_NEW)
        oracle = [prompt + ar_rows[0]]
        accepted = 0
        for make in (lambda: NgramDrafter(length=8, topk=1),
                     lambda: OracleTreeDrafter(oracle, cfg.vocab_size, max_nodes=9, seed=seed, shapes=("deep_chain",))):
            for delayed in (True, False):
                rows, res, cache = Decoder(model, make(), "chain", delayed=delayed).run(
                    torch.tensor([prompt]), INTERPRETED_NEW)
                assert rows == ar_rows, delayed
                assert_bitwise_state(cache, ar_cache)
                accepted += sum(r.accepted for r in res.rounds)
        assert accepted > 0


CASES = {
    "default_chains": lambda: [default_chains_equal_ar(seed) for seed in range(2)],
    "hybrid": lambda: [hybrid_chains(seed) for seed in range(4)],
    "routes": lambda: [routes_equal_ar_bitwise_in_bf16(seed) for seed in range(8)],
    "control": without_exact_mode_states_differ,
    "triton": lambda: [triton_kernels_and_graphs(seed) for seed in range(2)],
}

if __name__ == "__main__":
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT", "run with ATEN_CPU_CAPABILITY=default"
    torch.set_num_threads(1)
    CASES[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
