"""EAGLE drafter and pruned draft trees: exactness (float64), tree construction properties,
train/draft consistency, checkpoints, response data and resumable training (CPU, tiny shapes)."""

import contextlib
import itertools
import json
import lzma
import math
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specla import engine, fused, ops, topology
from specla.api import DEMO_DIR
from specla.checkpoint import load_model, save_model
from specla.config import ModelConfig
from specla.decode import Decoder
from specla.drafters import tree
from specla.drafters.base import MIN_WINDOW, attention_window, pad_drafts
from specla.drafters.eagle import (EagleConfig, EagleDrafter, EagleDrafterModel, find_drafter, load_drafter,
                                   save_drafter)
from specla.errors import CheckpointError, InputError
from specla.train.drafter import (ResponseBatches, ResponseSet, collect_responses, generate_responses, merge_responses,
                                  opening_turns, prompt_corpus, save_responses, train_drafter, training_prompts)

from conftest import random_model, tiny_config
from graph_emulation import emulate_graphs
from test_exactness import assert_same_state, make_prompt

NEW = 64
ROUTES = {"chain": dict(topk=1, depth=5), "tree": dict(topk=3, depth=4, budget=8, tau=4.0)}
NARROW_TREE = dict(topk=3, depth=4, budget=8, tau=4.0, width=1,  # a chain with each depth's runners-up,
                   temperature=1.0)  # scored by the plain log-probabilities
DEEP = {"chain": dict(topk=1, depth=12), "tree": dict(topk=4, depth=12, budget=16)}  # 12-deep drafts, as tree_shapes.py times


def random_drafter(cfg: ModelConfig, seed: int, dtype=torch.float64) -> EagleDrafterModel:
    torch.manual_seed(seed)
    return EagleDrafterModel(EagleConfig.for_target(cfg)).to(dtype).eval()


# exactness -----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_eagle_routes_equal_ar(seed):
    cfg = tiny_config(seed)
    model = random_model(cfg, seed)
    dm = random_drafter(cfg, seed)
    prompt = make_prompt(cfg, seed, 6 + seed % 5)
    ar_rows, _, ar_cache = Decoder(model).run(torch.tensor([prompt]), NEW)
    for route, opts in [*ROUTES.items(), ("tree", NARROW_TREE), *DEEP.items()]:
        for delayed in (True, False):
            rows, res, cache = Decoder(model, EagleDrafter(dm, model, **opts), route, delayed=delayed).run(
                torch.tensor([prompt]), NEW)
            assert rows == ar_rows, (route, delayed)
            assert_same_state(cache, ar_cache)
            assert all(r.drafted <= EagleDrafter(dm, model, **opts).budget for r in res.rounds)


def test_batched_rows_and_one_token_prompt():
    cfg = tiny_config(3)
    model = random_model(cfg, 3)
    dm = random_drafter(cfg, 3)
    prompts = torch.stack([torch.tensor(make_prompt(cfg, s, 8)) for s in range(3)])
    ar_rows, _, ar_cache = Decoder(model).run(prompts, 24)
    rows, _, cache = Decoder(model, EagleDrafter(dm, model, **ROUTES["tree"])).run(prompts, 24)
    assert rows == ar_rows
    assert_same_state(cache, ar_cache)
    # no prefill: the first round has no feature to draft from and proposes the root alone
    ar_rows, _, _ = Decoder(model).run(prompts[:1, :1], 16)
    rows, res, _ = Decoder(model, EagleDrafter(dm, model, **ROUTES["chain"])).run(prompts[:1, :1], 16)
    assert rows == ar_rows and res.rounds[0].drafted == 0 and res.rounds[1].drafted == 5


def test_unscored_chain_is_the_packed_rollout():
    """A chain without a pruning window skips the scores and the packing (`tree.top1`): its
    draft equals `build_batch` over the scored rollout, whose tokens it also proposes."""
    from specla.drafters import tree

    cfg = tiny_config(4)
    model = random_model(cfg, 4)
    dm = random_drafter(cfg, 4)
    x = torch.tensor([make_prompt(cfg, 4, 9), make_prompt(cfg, 5, 9)])
    drafter = EagleDrafter(dm, model, **{**ROUTES["chain"], "tau": None})
    drafter.reset(2)
    out = model(x[:, :-1], model.new_cache(2), capture=drafter.capture)
    drafter.extend(x[:, :-1], out.hidden, torch.full((2,), x.shape[1] - 1))
    root = x[:, -1]
    got = drafter.draft(root, drafter.k, drafter.v)
    pool = drafter.rollout(root, drafter.k, drafter.v)
    want = tree.build_batch(root, *pool, drafter.budget, None, max_depth=drafter.depth)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(drafter.rollout(root, drafter.k, drafter.v, scored=False)[0], pool[0])


@pytest.mark.parametrize("route", ["chain", "tree"])
def test_training_unroll_is_what_drafting_computes(route):
    """Every node of a rollout scores exactly what the training-time test computes for the same
    path: step k of the anchor before the root, with the path's tokens as inputs (scored by
    the plain log-probabilities: temperature 1)."""
    cfg = tiny_config(2)
    model = random_model(cfg, 2)
    dm = random_drafter(cfg, 2)
    x = torch.tensor([make_prompt(cfg, 2, 7)])
    drafter = EagleDrafter(dm, model, **{**ROUTES[route], "tau": None, "temperature": 1.0})
    out = model(x[:, :-1], model.new_cache(1), capture=drafter.capture)
    drafter.extend(x[:, :-1], out.hidden, torch.tensor([x.shape[1] - 1]))
    tok, par, score = (t[0].tolist() for t in drafter.rollout(x[:, -1], drafter.k, drafter.v))
    t = x.shape[1] - 2  # the anchor: the last consumed token
    for i in range(len(tok)):
        path = [i]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        y = torch.cat([x, torch.tensor([[tok[j] for j in reversed(path)]])], 1)
        feats = model(y, model.new_cache(1), capture=drafter.capture).hidden
        with torch.no_grad():
            hs = dm.unroll(dm.features([feats[j] for j in drafter.capture]), model.embeddings(y), len(path))
            q = sum(torch.log_softmax(dm.logits(h[0, t], model.lm_head.weight), -1)[y[0, t + k + 2]]
                    for k, h in enumerate(hs))
        assert abs(float(q) - score[i]) < 1e-10


# tree construction ---------------------------------------------------------------------------

def _fake_scorer(vocab: int, seed: int):
    """step(d, tokens, src, rows) for tree.beam_search: log-probs that depend on each beam's whole path."""
    paths = [[()]]

    def logp_of(path):
        g = torch.Generator().manual_seed(hash((seed,) + path) % 2**31)
        return torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 3, 0)

    def step(d, tokens, src, rows):
        new = [paths[-1][s] + ((t,) if d else ()) for s, t in zip(src[0].tolist(), tokens[0].tolist())]
        paths.append(new)
        return torch.stack([logp_of(p) for p in new])[None]

    return step, logp_of


def _brute_rollout(logp_of, vocab, topk, depth, width):
    """Beam top-k over explicit paths, `width` beams a depth: {path: q} of every proposed node."""
    q, beams, pool = {(): 0.0}, [()], {}
    for _ in range(depth):
        props = []
        for b in beams:
            lp = logp_of(b).tolist()
            for tok in sorted(range(vocab), key=lambda v: (-lp[v], v))[:topk]:
                q[b + (tok,)] = q[b] + lp[tok]
                props.append(b + (tok,))
        pool.update((p, q[p]) for p in props)
        beams = sorted(props, key=lambda p: -q[p])[:width]
    return pool


def _paths(tokens, parents):
    out = []
    for i in range(len(tokens)):
        out.append((out[parents[i]] if parents[i] >= 0 else ()) + (tokens[i],))
    return out


shapes = st.sampled_from([(1, 1), (1, 4), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2)])  # (topk, depth)


def _with_width(shape):
    """(topk, depth, width): width 1 or the top-k."""
    topk, depth = shape
    return st.sampled_from(sorted({1, topk})).map(lambda w: (topk, depth, w))


shapes = shapes.flatmap(_with_width)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, vocab=st.integers(3, 6), seed=st.integers(0, 10**6), budget=st.integers(1, 12),
       tau=st.one_of(st.none(), st.floats(0, 8)), scale=st.sampled_from([1.0, 2.0, 0.7]))
def test_tree_construction(shape, vocab, seed, budget, tau, scale):
    """scale: the scores are those of the tempered distribution, log-softmax(scale · logits)."""
    topk, depth, width = shape
    step, logp_of = _fake_scorer(vocab, seed)
    tok, par, score = (t[0].tolist() for t in tree.beam_search(step, torch.tensor([0]), topk, depth, tau,
                                                               width=width, scale=scale))
    pool = dict(zip(_paths(tok, par), score))
    best = max(score)
    inside = lambda s: tau is None or s >= best - tau  # noqa: E731
    # the rollout equals explicit enumeration (the window of it, with tau: the rollout stops early)
    brute = _brute_rollout(lambda path: torch.log_softmax(scale * logp_of(path), 0), vocab, topk, depth, width)
    # (the rollout subtracts each row's log-sum-exp, ~1e-16 here: the scorer's rows are
    # normalised; so each side takes the window from its own best score, with that slack)
    got, want = ({p: s for p, s in d.items() if tau is None or s >= max(d.values()) - tau - 1e-12}
                 for d in (pool, brute))
    assert got.keys() == want.keys() and all(got[p] == pytest.approx(want[p], abs=1e-12) for p in got)
    assert all(s <= pool[p[:-1]] for p, s in pool.items() if len(p) > 1)  # q never increases along a path

    kept = tree.select(score, par, budget, tau)
    assert len(kept) == min(budget, sum(inside(s) for s in score))
    assert all(inside(score[i]) for i in kept)
    # the kept set is the ancestor-closed subset of the window with the largest total score
    window = [i for i in range(len(score)) if inside(score[i])]
    best_set = max((set(c) for c in itertools.combinations(window, len(kept))
                    if all(par[i] < 0 or par[i] in c for i in c)), key=lambda c: sum(score[i] for i in c))
    assert math.isclose(sum(score[i] for i in kept), sum(score[i] for i in best_set), abs_tol=1e-12)

    tokens, parents = tree.pack(7, tok, par, score, kept)
    topology.as_parents(parents)  # topological
    assert tokens[0] == 7 and len(tokens) - 1 == len(kept) <= budget
    node = {p: j for j, p in enumerate(_paths(tokens[1:], [q - 1 for q in parents[1:]]), start=1)}
    assert set(node) == {_paths(tok, par)[i] for i in kept}  # the same nodes, ancestor-closed
    sc = [0.0] + [pool[p] for p in sorted(node, key=node.get)]
    depth_of = topology.depths(torch.tensor([parents]))[0].tolist()
    assert depth_of == sorted(depth_of)  # depth by depth
    for kids in topology.children(torch.tensor(parents)):
        assert [sc[c] for c in kids] == sorted((sc[c] for c in kids), reverse=True)  # best child first
    if len(tokens) > 1:
        assert parents[1] == 0 and sc[1] == max(sc[1:])  # node 1 is the best first token


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(1, 14), budget=st.integers(0, 14), tau=st.one_of(st.none(), st.floats(0, 3)))
def test_select_any_scores(data, n, budget, tau):
    """Scores that may increase along a path: missing ancestors are joined, the budget holds."""
    parents = [-1] + [data.draw(st.integers(-1, i - 1)) for i in range(1, n)]
    scores = data.draw(st.lists(st.floats(-5, 0), min_size=n, max_size=n))
    kept = tree.select(scores, parents, budget, tau)
    assert len(kept) <= budget and kept == sorted(set(kept))
    assert all(parents[i] < 0 or parents[i] in kept for i in kept)
    # every kept node is in the window or an ancestor joined for one that is
    best, depth = max(scores), tree.depths(parents)
    inside = {i for i in kept if tau is None or scores[i] >= best - tau}
    joined = {a for i in inside for a in itertools.accumulate(range(depth[i] - 1), lambda j, _: parents[j], initial=i)}
    assert set(kept) == joined
    top = min(range(n), key=lambda i: (-scores[i], depth[i], i))  # the best node fits whenever its path does
    assert (top in kept) == (depth[top] <= budget)


def test_entry_ancestors_is_the_ancestor_mask():
    """Rows built depth by depth from the previous depth's rows are the ancestor-or-self mask
    of the entries' tree."""
    g = torch.Generator().manual_seed(0)
    k, depth, B = 3, 4, 2
    E = 1 + (depth - 1) * k
    anc = torch.zeros(B, E, E, dtype=torch.bool)
    parents = torch.full((B, E), -1)
    src, rows, start, prev_start = torch.zeros(B, 1, dtype=torch.long), None, 0, 0
    for d in range(depth):
        n = src.shape[1]
        rows = tree.entry_ancestors(rows, src, start, E)
        anc[:, start:start + n] = rows
        if d:  # new entry i extends the previous depth's entry src[:, i]
            parents[:, start:start + n] = prev_start + src
        src = torch.randint(0, n, (B, k), generator=g)
        prev_start, start = start, start + n
    assert torch.equal(anc, topology.ancestor_mask(parents))


# checkpoints -----------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    from safetensors import safe_open

    cfg = tiny_config(1)
    model = random_model(cfg, 1)
    dm = random_drafter(cfg, 1)
    save_drafter(dm, tmp_path / "drafter")
    names = safe_open(str(tmp_path / "drafter" / "model.safetensors"), "pt").keys()
    assert not [n for n in names if "embed" in n or "lm_head" in n]
    back = load_drafter(tmp_path / "drafter", model)
    assert back.cfg == dm.cfg
    for (n, a), (_, b) in zip(dm.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    assert find_drafter(tmp_path) == tmp_path / "drafter" and find_drafter(tmp_path / "drafter") is None
    drafter = EagleDrafter.load(tmp_path / "drafter", model, topk=2, depth=3, budget=5)
    assert drafter.max_nodes == 6 and drafter.capture == tuple(dm.cfg.feature_layers)
    with pytest.raises(InputError, match="CUDA"):
        EagleDrafter(back, model, graphs=True)
    other = random_model(tiny_config(1, hidden_size=dm.cfg.hidden_size + 8), 1)
    with pytest.raises(CheckpointError, match="hidden size"):
        load_drafter(tmp_path / "drafter", other)


def test_demo_shape_fits_the_budget():
    from specla.data.tokenizer import load_tokenizer
    from specla.train.target import demo_config

    tcfg = demo_config(load_tokenizer(DEMO_DIR))
    cfg = EagleConfig.for_target(tcfg)
    assert cfg.feature_layers == [3, 6, 11]
    with torch.device("meta"):
        n = sum(p.numel() for p in EagleDrafterModel(cfg).parameters())
    assert n * 2 <= 4 * 10**6  # bf16, embedding and LM head shared with the target


# data and training -----------------------------------------------------------------------------

TINY = dict(vocab_size=48, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_heads=2, num_v_heads=2,
            head_dim=8, head_v_dim=8, max_position_embeddings=512)


def _response_data(tmp_path):
    model = random_model(ModelConfig(**TINY), 1)
    save_model(model, tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 48, (int(torch.randint(5, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(32)]
    done = generate_responses(model, prompts, 32, (), batch_size=8, progress=False)
    for i, p, r in done[:3]:  # each batch was cut to its shortest prompt; responses are AR's
        assert p == prompts[i][len(prompts[i]) - len(p):]
        assert r == Decoder(model).run(torch.tensor([p]), 32)[0][0]
    save_responses(tmp_path / "data.npz", [p for _, p, _ in done], [r for _, _, r in done], ["x"] * 32, {"k": 1})
    return model


def test_response_batches_have_a_width_divisible_by_16(tmp_path):
    """Every batch is right-padded to a multiple of 16 (one Triton specialisation of the frozen
    target's kernels for every batch); the sequences and their labels are unchanged."""
    prompts = [[1] * (3 + i % 4) for i in range(20)]
    responses = [[2 + i] * (5 + 7 * i) for i in range(20)]
    save_responses(tmp_path / "d.npz", prompts, responses, ["x"] * 20, {})
    data = ResponseSet(tmp_path / "d.npz")
    widths = set()
    for seed in (None, 0):
        batches = ResponseBatches(data, np.arange(20), 3, 100, seed)
        for step in range(8):
            tokens, valid = batches.get(step)
            widths.add(tokens.shape[1])
            assert tokens.shape[1] % 16 == 0
            for row, v in zip(tokens.tolist(), valid):
                i = row[len([t for t in row if t == 1])] - 2  # which sequence: its response token
                seq = (prompts[i] + responses[i])[:100]
                assert row[:len(seq)] == seq and not any(row[len(seq):])
                assert v.nonzero().flatten().tolist() == list(range(len(prompts[i]) - 1, len(seq) - 1))
    assert len(widths) > 1


def test_training_resumes_and_raises_acceptance(tmp_path):
    model = _response_data(tmp_path)
    data = ResponseSet(tmp_path / "data.npz")
    assert len(data) == 32 and data.meta == {"k": 1} and len(data.sequence(0)) == data.prompt_len[0] + 32
    kw = dict(total_steps=150, batch_size=8, seq_len=64, lr=3e-3, warmup=5, unroll=3, eval_every=100,
              eval_batches=2, log_every=1, device="cpu", progress=False)
    whole = train_drafter(tmp_path / "target", tmp_path / "whole", tmp_path / "data.npz", **kw)
    first = train_drafter(tmp_path / "target", tmp_path / "run", tmp_path / "data.npz", max_minutes=0.0, **kw)
    assert first["step"] == 1 and not first["finished"]
    second = train_drafter(tmp_path / "target", tmp_path / "run", tmp_path / "data.npz", **kw)
    assert second["step"] == 150 and second["finished"] and whole["finished"]
    # each of a run's first steps timed alone, and its parts (where one-time costs sit)
    assert [set(p) for p in whole["first_steps_phases"]] == [{"batch", "target", "update"}] * 5
    assert all(sum(p.values()) <= s + 5e-3 for p, s in zip(whole["first_steps_phases"], whole["first_steps_seconds"]))
    a = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)  # resuming changes nothing
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert len([r for r in log if "val_accept_length" in r]) >= 2
    assert set(json.loads((tmp_path / "run" / "export" / "training_state.json").read_text())) >= {"step", "val_top1"}
    # a run that lost ckpt.pt continues from the export
    again = train_drafter(tmp_path / "target", tmp_path / "run2", tmp_path / "data.npz", init_from=tmp_path / "run" / "export",
                          **{**kw, "total_steps": 152})
    assert again["step"] == 152 and again["sequences_seen"] == second["sequences_seen"] + 16

    # on the prompts it trained on, the trained drafter is accepted more than an untrained one, still exactly
    trained = load_drafter(tmp_path / "run" / "export", model)
    untrained = random_drafter(model.cfg, 0)
    prompts = [data.sequence(i)[:data.prompt_len[i]].tolist() for i in range(4)]
    ar = [Decoder(model).run(torch.tensor([p]), 32)[0] for p in prompts]
    accepted = {}
    for name, dm in (("trained", trained), ("untrained", untrained)):
        accepted[name] = 0
        for route, opts in ROUTES.items():
            for p, want in zip(prompts, ar):
                rows, res, _ = Decoder(model, EagleDrafter(dm, model, **opts), route).run(torch.tensor([p]), 32)
                assert rows == want
                accepted[name] += sum(r.accepted for r in res.rounds)
    assert accepted["trained"] > 2 * accepted["untrained"] + 10, accepted


def test_opening_turns():
    text = ("<|bos|><|system|>\nBe brief.\n<|user|>\nHi\nthere\n<|assistant|>\nHello<|eos|>"
            "<|user|>\nMore\n<|assistant|>\nOk<|eos|>")
    assert opening_turns(text) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    assert opening_turns("<|bos|><|assistant|>\nx<|eos|>") == []


def test_prompt_corpus_picks_the_same_prompts(tmp_path):
    from specla.data.chat import render_chat

    src = tmp_path / "corpus"
    src.mkdir()
    with lzma.open(src / "train.jsonl.xz", "wt") as f:
        for i in range(40):
            turns = [{"role": "system", "content": "Be brief."}] * (i % 3 == 0) + [
                {"role": "user", "content": f"question {i}?\nline two"}, {"role": "assistant", "content": "answer"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
            f.write(json.dumps({"source": "sharegpt", "id": f"c{i}_{i % 3}", "text": render_chat(turns)}) + "\n")
            f.write(json.dumps({"source": "pydocs", "id": f"d{i}", "text": "<|bos|>text<|eos|>"}) + "\n")
    summary = prompt_corpus(src, tmp_path / "prompts")
    assert summary["records"] == 14  # first chunks (_0) only
    for n in (5, 20):
        assert training_prompts(tmp_path / "prompts", n, 0.4, seed=3) == training_prompts(src, n, 0.4, seed=3)


def test_collect_responses(tmp_path):
    """End to end on a tiny target with the demo tokenizer and a two-source corpus."""
    from specla.data.chat import render_chat

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    chats = [[{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": "answer"}] for i in range(6)]
    with lzma.open(corpus / "train.jsonl.xz", "wt") as f:
        for i, turns in enumerate(chats):
            f.write(json.dumps({"source": "sharegpt", "id": f"c{i}_{i % 2}", "text": render_chat(turns)}) + "\n")
        f.write(json.dumps({"source": "pydocs", "id": "d", "text": "<|bos|>text<|eos|>"}) + "\n")
    model = random_model(ModelConfig(**{**TINY, "vocab_size": 8192}), 2)
    save_model(model, tmp_path / "target")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, tmp_path / "target" / name)
    summary = collect_responses(tmp_path / "target", tmp_path / "resp.npz", n_prompts=5, max_new_tokens=6,
                                corpus_dir=corpus, gsm8k_share=0.4, max_prompt_tokens=40, batch_size=2, progress=False)
    data = ResponseSet(tmp_path / "resp.npz")
    # 3 ShareGPT conversation openers (chunk _0) and 2 GSM8K questions
    assert summary["sequences"] == len(data) == 5 and sorted(data.source.tolist()) == ["gsm8k"] * 2 + ["sharegpt"] * 3
    tok_model = load_model(tmp_path / "target")
    for i in range(len(data)):
        seq, n = data.sequence(i).tolist(), int(data.prompt_len[i])
        assert seq[:3] == [0, 4, 204] and len(seq) == n + 6 and n <= 40  # the chat header survives cuts
        assert seq[n:] == Decoder(tok_model).run(torch.tensor([seq[:n]]), 6)[0][0]
    # two shards of the same collection, merged, hold the same sequences
    for k in range(2):
        collect_responses(tmp_path / "target", tmp_path / f"part{k}.npz", n_prompts=5, max_new_tokens=6,
                          corpus_dir=corpus, gsm8k_share=0.4, max_prompt_tokens=40, batch_size=2, shard=(k, 2),
                          progress=False)
    merged = merge_responses(tmp_path / "merged.npz", [tmp_path / "part0.npz", tmp_path / "part1.npz"])
    both = ResponseSet(tmp_path / "merged.npz")
    assert merged["sequences"] == len(both) == 5
    assert sorted(tuple(both.sequence(i).tolist()) for i in range(5)) == \
        sorted(tuple(data.sequence(i).tolist()) for i in range(5))


def test_held_out_gsm8k_is_what_training_prompts_leaves(tmp_path):
    """`held_out_gsm8k` names exactly the GSM8K training questions a collection did not pick."""
    import lzma

    from specla.data.suites import load_gsm8k_train
    from specla.train.drafter import held_out_gsm8k, training_prompts

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with lzma.open(corpus / "train.jsonl.xz", "wt") as f:
        f.write(json.dumps({"source": "pydocs", "id": "d", "text": "<|bos|>text<|eos|>"}) + "\n")
    questions = [q["question"] for q in load_gsm8k_train()]
    for n_prompts, share, seed in ((16384, 0.45, 0), (2000, 1.0, 3)):
        picked = {t[0]["content"] for src, t in training_prompts(corpus, n_prompts, share, seed) if src == "gsm8k"}
        left = held_out_gsm8k(n_prompts, share, seed)
        assert len(picked) + len(left) == len(questions)
        assert not picked & {questions[i] for i in left}


def test_sampling_is_lossless():
    """Deterministic top-k proposals are point masses: sampled output follows the target's law."""
    from specla.decode import Sampling
    from test_sampling import N, check_fit, empirical, exact_joint

    cfg = tiny_config(7, vocab_size=5, hidden_size=16, num_hidden_layers=2, num_heads=1, num_v_heads=2,
                      head_dim=4, head_v_dim=4, use_short_conv=True)
    model = random_model(cfg, 7)
    prompt = [1, 3, 0, 2, 4, 1]
    probs, _ = exact_joint(model, prompt, 1.0, 0.9)
    drafter = EagleDrafter(random_drafter(cfg, 7), model, topk=2, depth=2, initial_capacity=16)
    rows, _, _ = Decoder(model, drafter, "tree", sampling=Sampling(1.0, 0.9, seed=3)).run(torch.tensor([prompt] * N), 3)
    assert check_fit(empirical(rows, cfg.vocab_size), probs) > 0.001


@settings(max_examples=80, deadline=None)
@given(shape=shapes, vocab=st.integers(3, 6), seeds=st.lists(st.integers(0, 10**6), min_size=1, max_size=3),
       budget=st.integers(1, 12), tau=st.one_of(st.none(), st.floats(0, 8)))
def test_build_batch_equals_build(shape, vocab, seeds, budget, tau):
    """The on-device select + pack of a batch equals `build` + `pad_drafts` row by row (ties
    included: the fake scorer's log-probabilities are coarse)."""
    topk, depth, width = shape
    pools = []
    for seed in seeds:
        step, _ = _fake_scorer(vocab, seed)
        coarse = lambda d, t, src, rows, _s=step: (_s(d, t, src, rows) * 2).round() / 2  # noqa: E731  (ties)
        pools.append(tree.beam_search(coarse, torch.tensor([0]), topk, depth, width=width))  # full, as graphs run it
    tok, par, score = (torch.cat([p[i] for p in pools]) for i in range(3))
    root = torch.arange(7, 7 + len(seeds))
    out_tok, out_par, valid = tree.build_batch(root, tok, par, score, budget, tau, max_depth=depth)
    # the pool's fixed layout gives the same depths as its parents
    assert torch.equal(tree.pool_depths(tok.shape[1], topk, width, tok.device).expand_as(par),
                       topology.depths(torch.cat([torch.full((len(seeds), 1), -1), par + 1], 1))[:, 1:])
    for got, want in zip(tree.build_batch(root, tok, par, score, budget, tau,
                                          depth=tree.pool_depths(tok.shape[1], topk, width, tok.device)),
                         (out_tok, out_par, valid)):
        assert torch.equal(got, want)
    M = min(budget, tok.shape[1])
    assert out_tok.shape == out_par.shape == (len(seeds), M + 1)
    for b in range(len(seeds)):
        want_tok, want_par = tree.build(int(root[b]), tok[b].tolist(), par[b].tolist(), score[b].tolist(), budget, tau)
        n = len(want_tok)
        assert int(valid[b]) == n
        pad = pad_drafts([(want_tok, want_par), ([0] * (M + 1), list(range(-1, M)))])
        assert out_tok[b].tolist() == pad.tokens[0].tolist() and out_par[b].tolist() == pad.parents[0].tolist()


@pytest.mark.parametrize("route", ["chain", "tree", "narrow tree"])
def test_graphed_drafting_equals_eager(monkeypatch, route):
    """The drafter's graphed rollout and extend (emulated on CPU) draft and track what the eager
    drafter does, across cache growth and generations reusing the drafter: the same tokens,
    rounds, lengths and pending feature, and the same cache up to float64 rounding (the graphed
    drafter reads a prompt in fixed-width chunks, so its matmuls group the sums differently)."""
    emulate_graphs(monkeypatch)
    cfg = tiny_config(1)
    model = random_model(cfg, 1)
    dm = random_drafter(cfg, 1)
    opts = NARROW_TREE if route == "narrow tree" else ROUTES[route]
    route = route.split()[-1]
    eager = EagleDrafter(dm, model, initial_capacity=16, **opts)
    graphed = EagleDrafter(dm, model, initial_capacity=16, **opts)
    graphed.graphs = True  # CUDA graphs in name; the emulation above runs them on CPU
    for seed in (1, 2):  # the second generation reuses the drafter (cache emptied in place)
        prompt = torch.tensor([make_prompt(cfg, seed, 10)])
        ar = Decoder(model).run(prompt, 40)[0]
        a = Decoder(model, eager, route).run(prompt, 40)
        b = Decoder(model, graphed, route).run(prompt, 40)
        assert a[0] == b[0] == ar
        assert [r.accepted for r in a[1].rounds] == [r.accepted for r in b[1].rounds]
        assert torch.equal(eager.len, graphed.len)
        torch.testing.assert_close(eager.pending, graphed.pending, rtol=0, atol=1e-12)
        n = int(eager.len.max())
        torch.testing.assert_close(eager.k[:, :, :n], graphed.k[:, :, :n], rtol=0, atol=1e-12)
    assert graphed.capacity > 16 and graphed._extend_graphs  # the cache grew; extend ran from a graph
    # the prompt's (first) chunk replayed a graph too; a round's extend reads the accepted path's
    # longest possible width, not the node budget
    W = engine.PREFILL_WIDTH  # the prompt's 15 tokens take one chain-wide chunk
    assert set(graphed._extend_graphs) == {(W, True), (graphed.depth + 1, False)}
    # prefill in chunks of another width: no extend graph of a new width (it would compile
    # mid-generation); the chunks after the first take the prompt width's other graph
    prompt = torch.tensor([make_prompt(cfg, 3, 14)])  # 20 tokens: chunks of 8, 8 and 3
    ar = Decoder(model).run(prompt, 16)[0]
    assert Decoder(model, graphed, route, prefill_chunk=8).run(prompt, 16)[0] == ar
    assert set(graphed._extend_graphs) == {(W, True), (W, False), (graphed.depth + 1, False)}


def test_graphed_prompt_extend_takes_the_target_chunks(monkeypatch):
    """A long prompt's extend goes in the target's prefill chunks (`engine.prompt_chunks`), a
    replay each: 600 prefilled tokens as 512 + 88 (128 wide), not 19 chunks of 32; the drafter
    then tracks and drafts what the eager one does."""
    emulate_graphs(monkeypatch)
    cfg = tiny_config(1, max_position_embeddings=1024)
    model = random_model(cfg, 1)
    dm = random_drafter(cfg, 1)
    # room from the start: growing the cache drops the graphs over it
    eager = EagleDrafter(dm, model, initial_capacity=1024, **ROUTES["chain"])
    graphed = EagleDrafter(dm, model, initial_capacity=1024, **ROUTES["chain"])
    graphed.graphs = True
    prompt = torch.tensor([make_prompt(cfg, 4, 401)])  # 601 tokens
    a = Decoder(model, eager, "chain").run(prompt, 12)
    b = Decoder(model, graphed, "chain").run(prompt, 12)
    assert a[0] == b[0] == Decoder(model).run(prompt, 12)[0]
    assert [r.accepted for r in a[1].rounds] == [r.accepted for r in b[1].rounds]
    assert set(graphed._extend_graphs) == {(512, True), (128, False), (graphed.depth + 1, False)}
    assert torch.equal(eager.len, graphed.len)
    torch.testing.assert_close(eager.pending, graphed.pending, rtol=0, atol=1e-12)
    n = int(eager.len.max())
    torch.testing.assert_close(eager.k[:, :, :n], graphed.k[:, :, :n], rtol=0, atol=1e-12)


@pytest.mark.parametrize("route", ["chain", "tree"])
def test_graphed_round_reads_the_draft_and_the_path_in_place(monkeypatch, route):
    """On a graphed target (emulated) a graphed drafter's draft goes to the target's round
    graph and the round's accepted path to the drafter's extend graph without copies: each
    graph reads the other's outputs where they are. No draft is staged into the target's
    buffers, and the tokens, rounds, drafter length, pending feature and cache equal the eager
    pair's, over two generations that reuse both (the extend graph's capture restores the
    drafter's state it advanced)."""
    from specla import engine

    emulate_graphs(monkeypatch)
    staged = []
    real_stage = engine.GraphTarget._stage
    monkeypatch.setattr(engine.GraphTarget, "_stage", lambda self, *a: staged.append(1) or real_stage(self, *a))
    cfg = tiny_config(1)
    model = random_model(cfg, 1)
    dm = random_drafter(cfg, 1)
    eager = EagleDrafter(dm, model, initial_capacity=64, **ROUTES[route])
    graphed = EagleDrafter(dm, model, initial_capacity=64, **ROUTES[route])
    graphed.graphs = True  # emulated on CPU
    targets: dict = {}
    for seed in (1, 2):
        prompt = torch.tensor([make_prompt(cfg, seed, 10)])
        ar = Decoder(model).run(prompt, 30)[0]
        a = Decoder(model, eager, route).run(prompt, 30)
        b = Decoder(model, graphed, route, graphs=True, targets=targets).run(prompt, 30)
        assert a[0] == b[0] == ar
        assert [r.accepted for r in a[1].rounds] == [r.accepted for r in b[1].rounds]
        assert torch.equal(eager.len, graphed.len)
        torch.testing.assert_close(eager.pending, graphed.pending, rtol=0, atol=1e-12)
        n = int(eager.len.max())
        torch.testing.assert_close(eager.k[:, :, :n], graphed.k[:, :, :n], rtol=0, atol=1e-12)
    assert staged == []
    assert any(k[0] == "in place" for k in graphed._extend_graphs)
    (target,) = targets.values()
    assert any(len(k) > 3 for k in target.graphs if k[0] == "round")  # the draft's graph, read in place


def test_attention_window_holds_the_committed_entries_and_the_rollout():
    for capacity, bound, extra, horizon in itertools.product((16, 300, 4096), (0, 5, 120, 290), (0, 10, 33),
                                                             (None, 50, 4000)):
        if bound + extra > capacity:
            continue  # `kv_room` grows the cache first
        w = attention_window(capacity, bound, extra, horizon)
        need = (bound if horizon is None else min(bound, horizon)) + extra
        assert need <= w <= capacity
        assert w == capacity or (w >= MIN_WINDOW and w & (w - 1) == 0 and (w == MIN_WINDOW or w < 2 * need))


def test_drafting_attends_over_a_window_of_a_large_cache(monkeypatch):
    """A long-lived drafter whose cache grew for a long prompt attends, for a short one, over
    the leading slots its horizon needs (one graph per window), and drafts exactly what a
    drafter whose cache is no larger than the context drafts."""
    emulate_graphs(monkeypatch)
    cfg = tiny_config(1)
    model = random_model(cfg, 1)
    dm = random_drafter(cfg, 1)
    small = EagleDrafter(dm, model, initial_capacity=16, **ROUTES["tree"])
    large = EagleDrafter(dm, model, initial_capacity=1024, **ROUTES["tree"])
    large.graphs = True  # emulated on CPU
    for seed, length in ((4, 200), (5, 10)):  # prompts of 300 and 15 tokens
        prompt = torch.tensor([make_prompt(cfg, seed, length)])
        ar = Decoder(model).run(prompt, 24)[0]
        a = Decoder(model, small, "tree").run(prompt, 24)
        b = Decoder(model, large, "tree").run(prompt, 24)
        assert a[0] == b[0] == ar
        assert [r.accepted for r in a[1].rounds] == [r.accepted for r in b[1].rounds]
    assert large.capacity == 1024 and sorted(large._graphs) == [(128, 4), (512, 4)]  # 15 + 24 + 10 entries; 300 + 24 + 10


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile on CPU needs a C++ compiler (none found)")
def test_compiled_graphed_drafting_equals_eager(monkeypatch):
    """With a compile mode (its own, or a fused target's) the graphed rollout and extend run
    compiled (specla.fused): the drafts equal the eager drafter's (fp64: compiled rounding
    differs by ~1 ulp, far from any beam decision) and the outputs equal AR's. The attention
    window is symbolic in the compiled rollout: wider windows capture new graphs, never compile."""
    emulate_graphs(monkeypatch)
    cfg = tiny_config(1)
    model = random_model(cfg, 1)
    dm = random_drafter(cfg, 1)
    graphed = EagleDrafter(dm, model, initial_capacity=256, compile="default", **ROUTES["tree"])
    eager = EagleDrafter(dm, model, initial_capacity=16, **ROUTES["tree"])
    graphed.graphs = True
    # prompts of 225 and 15 tokens: a window as wide as the cache (256: 224 + 10 entries, at most
    # 232 + 10 with 8 new tokens), then a narrower one (128), which must not recompile
    for i, (length, new) in enumerate(((150, 8), (10, 24))):
        prompt = torch.tensor([make_prompt(cfg, 3 + i, length)])
        ar = Decoder(model).run(prompt, new)[0]
        a = Decoder(model, eager, "tree").run(prompt, new)
        before = fused._compile_count()
        b = Decoder(model, graphed, "tree").run(prompt, new)
        if i == 0:
            assert fused._compile_count() >= before + 2  # the rollout and extend compiled
        else:
            assert fused._compile_count() == before
        assert a[0] == b[0] == ar
        assert [r.accepted for r in a[1].rounds] == [r.accepted for r in b[1].rounds]
        n = int(eager.len.max())
        torch.testing.assert_close(eager.k[:, :, :n], graphed.k[:, :, :n], rtol=1e-9, atol=1e-9)
    assert sorted(graphed._graphs) == [(128, graphed.depth), (256, graphed.depth)] and graphed.capacity == 256


def test_drafter_graphs_follow_the_target_fusion():
    """No compile mode of its own: the drafter's graphs compile exactly when the target is
    fused (`fused.fuse`, or SPECLA_COMPILE when a target is built)."""
    cfg = tiny_config(1)
    model = random_model(cfg, 1)
    d = EagleDrafter(random_drafter(cfg, 1), model)
    assert fused.mode_of(model) is None and d._graph_fns()[2] is contextlib.nullcontext
    fused.fuse(model)  # builds the regions; nothing compiles until a call
    try:
        assert fused.mode_of(model) == "default" and d._graph_fns()[2] is fused.no_compiles
    finally:
        fused.fuse(model, False)


@pytest.mark.parametrize("n", [1, 4])
def test_fp32_attention_equals_sdpa(n):
    """fp32 drafts' masked attention (`ops.masked_attention`; fp32 SDPA is a slow kernel on
    CUDA): the same values as SDPA, with masked-out keys ignored."""
    cfg = tiny_config()
    dm = EagleDrafterModel(EagleConfig.for_target(cfg)).float()
    g = torch.Generator().manual_seed(n)
    H, hd, L = dm.cfg.num_heads, dm.cfg.head_dim, 11
    q = torch.randn(2, n, H, hd, generator=g)
    keys, values = torch.randn(2, H, L, hd, generator=g), torch.randn(2, H, L, hd, generator=g)
    mask = torch.rand(2, n, L, generator=g) < 0.6
    mask[..., 0], mask[..., 5] = True, False
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), keys.double(), values.double(), attn_mask=mask[:, None], scale=dm.scale)
    out = ops.masked_attention(q, keys, values, mask, dm.scale)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), ref.transpose(1, 2).flatten(2), atol=1e-6)
    keys[:, :, 5], values[:, :, 5] = 1e4, 1e4  # a masked key and its value leave no trace
    assert torch.equal(ops.masked_attention(q, keys, values, mask, dm.scale), out)


# adaptive depth ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 4])  # seeds whose random drafters get some drafts accepted
def test_adaptive_depth_routes_equal_ar(seed):
    """A depth chosen each round from the last report read (`tree.DepthPolicy`) drafts trees and
    chains of two sizes in one generation: every output and state is AR's, and the rounds use
    both depths."""
    cfg = tiny_config(seed)
    model = random_model(cfg, seed)
    dm = random_drafter(cfg, seed)
    prompt = make_prompt(cfg, seed, 6 + seed % 5)
    ar_rows, _, ar_cache = Decoder(model).run(torch.tensor([prompt]), NEW)
    for route, opts in [("tree", dict(topk=4, depth=(1, 6), budget=16)), ("chain", dict(topk=1, depth=(1, 5)))]:
        drafter = EagleDrafter(dm, model, **opts)
        used, choose = [], drafter._round_depth
        drafter._round_depth = lambda: used.append(choose()) or used[-1]
        rows, res, cache = Decoder(model, drafter, route).run(torch.tensor([prompt]), NEW)
        assert rows == ar_rows, route
        assert_same_state(cache, ar_cache)
        assert set(used) == {1, opts["depth"][1]}, (route, used)
        # a one-deep rollout proposes the root's top-k (a tree) or one token (a chain)
        assert all(r.drafted <= (4 if route == "tree" else 1) for r, d in zip(res.rounds, used) if d == 1)


def test_depth_policy_follows_the_reports():
    """The policy's choice: shallow at the start and after a short acceptance, deep after one of
    at least `shallow` drafts; the drafter applies the report of its oldest unread proposal."""
    p = tree.DepthPolicy(3, 7)
    assert [p.choose(a) for a in (None, 0, 2, 3, 7)] == [3, 3, 3, 7, 7]
    cfg = tiny_config(0)
    model = random_model(cfg, 0)
    drafter = EagleDrafter(random_drafter(cfg, 0), model, topk=2, depth=(3, 7), budget=8)
    assert drafter.depth == 7 and drafter.max_path == 8
    drafter.reset(1)
    assert [drafter._round_depth() for _ in range(2)] == [3, 3]  # two rounds in flight, no report yet
    drafter.observe([3])  # the first round accepted 3 of its 3
    assert drafter._round_depth() == 7
    drafter.observe([1])  # the second accepted 1
    assert drafter._round_depth() == 3
    with pytest.raises(InputError):
        EagleDrafter(random_drafter(cfg, 0), model, depth=(5, 5))
