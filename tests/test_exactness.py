"""float64 on CPU: every speculative route emits exactly AR's greedy tokens, and the committed
state after a flush equals the state AR reaches after the same tokens (DESIGN §2)."""

import pytest
import torch

from specla.decode import Decoder
from specla.drafters.ngram import NgramDrafter
from specla.state import GDNLayerState

from conftest import random_model, tiny_config
from drafters import OracleTreeDrafter

NEW = 64


def assert_same_state(a, b, tol=1e-10):
    assert torch.equal(a.length, b.length)
    for sa, sb in zip(a.layers, b.layers):
        assert isinstance(sa, GDNLayerState)
        for st in (sa, sb):  # flushed: nothing left pending
            assert st.pending is None or int(st.pending[3].sum()) == 0
        assert (sa.S - sb.S).abs().max().item() < tol
        if sa.conv is not None:
            assert (sa.conv - sb.conv).abs().max().item() < tol


def make_prompt(cfg, seed, length):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
    return base + base[: length // 2]  # a repeat gives the n-gram drafter something to find


@pytest.mark.parametrize("seed", range(20))
def test_speculative_routes_equal_ar(seed):
    cfg = tiny_config(seed)
    model = random_model(cfg, seed)
    prompt = make_prompt(cfg, seed, 6 + seed % 9)
    ar_rows, _, ar_cache = Decoder(model).run(torch.tensor([prompt]), NEW)
    oracle = [prompt + ar_rows[0]]
    drafters = [
        ("chain", lambda: NgramDrafter(length=8, topk=1)),
        ("tree", lambda: NgramDrafter(length=4, topk=3, budget=10)),
        ("tree", lambda: OracleTreeDrafter(oracle, cfg.vocab_size, max_nodes=12, seed=seed)),
    ]
    accepted_any = False
    for route, make in drafters:
        for delayed in (True, False):
            rows, res, cache = Decoder(model, make(), route, delayed=delayed).run(torch.tensor([prompt]), NEW)
            assert rows == ar_rows, (route, delayed)
            assert_same_state(cache, ar_cache)
            accepted_any |= any(r.accepted > 0 for r in res.rounds)
            if isinstance(make(), OracleTreeDrafter):
                # the oracle drafter exercises rejections of every kind, and long acceptances
                assert any(r.accepted == 0 and r.drafted > 0 for r in res.rounds)
                assert max(r.accepted for r in res.rounds) >= 3
    assert accepted_any


def test_batched_rows_are_independent():
    """Rows with different topologies in one batch each match their own AR run."""
    cfg = tiny_config(3)
    model = random_model(cfg, 3)
    prompts = torch.stack([torch.tensor(make_prompt(cfg, s, 8)) for s in range(3)])
    ar_rows, _, ar_cache = Decoder(model).run(prompts, 24)
    oracle = [p + r for p, r in zip(prompts.tolist(), ar_rows)]
    rows, _, cache = Decoder(model, OracleTreeDrafter(oracle, cfg.vocab_size, seed=1)).run(prompts, 24)
    assert rows == ar_rows
    assert_same_state(cache, ar_cache)


def test_eos_and_max_tokens_truncate_the_commit():
    """Stopping mid-round consumes exactly the emitted tokens, as AR would."""
    cfg = tiny_config(5)
    model = random_model(cfg, 5)
    prompt = make_prompt(cfg, 5, 10)
    full, _, _ = Decoder(model).run(torch.tensor([prompt]), 40)
    eos = full[0][17]
    ar = Decoder(model, eos_token_ids={eos}).generate(prompt, 40)
    assert ar.tokens[-1] == eos and ar.stop_reason == "eos"
    oracle = [prompt + full[0]]
    for n in (7, 13, 40):
        spec_rows, res, cache = Decoder(model, OracleTreeDrafter(oracle, cfg.vocab_size, hit=0.95),
                                        eos_token_ids={eos}).run(torch.tensor([prompt]), n)
        want_rows, _, want_cache = Decoder(model, eos_token_ids={eos}).run(torch.tensor([prompt]), n)
        assert spec_rows == want_rows
        assert_same_state(cache, want_cache)
