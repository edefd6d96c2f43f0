"""Sampling routes are lossless: the joint law of the next 3 tokens equals AR's (chi-square)."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specla import acceptance
from specla.decode import Decoder, Sampling

from conftest import random_model, tiny_config
from drafters import SampledTreeDrafter

N = 20_000
STEPS = 3


def exact_joint(model, prompt, temperature, top_p):
    """P(x1, x2, x3 | prompt) enumerated from the model's own next-token distributions."""
    V = model.cfg.vocab_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=STEPS)))  # [V^3, 3]
    ctx = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    logits = model(ctx, model.new_cache(len(seqs))).logits[:, len(prompt) - 1: -1]  # predicts x1..x3
    p = acceptance.target_probs(logits, temperature, top_p)  # [V^3, 3, V]
    step = p.gather(2, seqs[:, :, None]).squeeze(2)
    return step.prod(1), seqs


def empirical(rows, V):
    idx = torch.tensor([r[:STEPS] for r in rows])
    flat = (idx * torch.tensor([V * V, V, 1])).sum(1)
    return torch.bincount(flat, minlength=V ** STEPS).double()


def check_fit(counts, probs):
    assert counts[probs == 0].sum() == 0, "a sample fell outside the target's support"
    expected = probs * counts.sum()
    keep = expected >= 5  # pool rare cells, as chi-square needs
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs.numpy(), exp.numpy()).pvalue


CASES = [
    # (name, depth, fanout, deterministic, temperature, top_p)
    ("chain-stochastic", 3, 1, False, 1.0, 1.0),
    ("tree-stochastic", 2, 2, False, 0.8, 0.9),
    ("chain-topk", 3, 1, True, 1.0, 1.0),
    ("tree-topk", 2, 3, True, 1.2, 0.95),
]


@pytest.mark.parametrize("name,depth,fanout,det,temperature,top_p", CASES)
def test_joint_distribution_matches_ar(name, depth, fanout, det, temperature, top_p):
    cfg = tiny_config(7, vocab_size=5, hidden_size=16, num_hidden_layers=2, num_heads=1, num_v_heads=2,
                      head_dim=4, head_v_dim=4, use_short_conv=True)
    model = random_model(cfg, 7)
    prompt = [1, 3, 0, 2, 4, 1]
    probs, _ = exact_joint(model, prompt, temperature, top_p)
    drafter = SampledTreeDrafter(model, depth, fanout, temperature, top_p, deterministic=det, seed=11)
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=1234)
    rows, _, _ = Decoder(model, drafter, "tree", sampling=sampling).run(torch.tensor([prompt] * N), STEPS)
    pvalue = check_fit(empirical(rows, cfg.vocab_size), probs)
    assert pvalue > 0.001, f"{name}: chi-square p = {pvalue:.2e}"


def test_ar_sampling_matches_and_test_has_power():
    """The harness itself: AR passes, and a subtly wrong sampler (no top-p) is rejected."""
    cfg = tiny_config(7, vocab_size=5, hidden_size=16, num_hidden_layers=2, num_heads=1, num_v_heads=2,
                      head_dim=4, head_v_dim=4, use_short_conv=True)
    model = random_model(cfg, 7)
    prompt = [1, 3, 0, 2, 4, 1]
    probs, _ = exact_joint(model, prompt, 0.8, 0.9)
    rows, _, _ = Decoder(model, sampling=Sampling(0.8, 0.9, seed=5)).run(torch.tensor([prompt] * N), STEPS)
    counts = empirical(rows, cfg.vocab_size)
    assert check_fit(counts, probs) > 0.001
    wrong, _, _ = Decoder(model, sampling=Sampling(0.8, 1.0, seed=5)).run(torch.tensor([prompt] * N), STEPS)
    wcounts = empirical(wrong, cfg.vocab_size)
    assert wcounts[probs == 0].sum() > 0 or check_fit(wcounts, probs) < 1e-6


@pytest.mark.parametrize("drafted", [False, True])
def test_exact_mode_sampling_matches_the_target(drafted):
    """Exact mode (every target call verifies one width; AR steps verify the root alone)
    samples from the same law: AR and a sampled-tree route, 20k rows each."""
    cfg = tiny_config(7, vocab_size=5, hidden_size=16, num_hidden_layers=2, num_heads=1, num_v_heads=2,
                      head_dim=4, head_v_dim=4, use_short_conv=True)
    model = random_model(cfg, 7)
    prompt = [1, 3, 0, 2, 4, 1]
    probs, _ = exact_joint(model, prompt, 1.0, 0.9)
    drafter = SampledTreeDrafter(model, 2, 2, 1.0, 0.9, seed=3) if drafted else None
    rows, _, _ = Decoder(model, drafter, "tree" if drafted else "ar", sampling=Sampling(1.0, 0.9, seed=9),
                         exact_width=8).run(torch.tensor([prompt] * N), STEPS)
    assert check_fit(empirical(rows, cfg.vocab_size), probs) > 0.001
