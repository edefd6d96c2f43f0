"""Shared fixtures. Triton runs under its interpreter on CPU; set before anything imports it."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from specla.config import ModelConfig  # noqa: E402

import fast_interpreter  # noqa: E402

fast_interpreter.install()

# Tiny shapes: one thread is much faster than two fighting over small matmuls.
torch.set_num_threads(1)
from specla.model import GatedDeltaNet, Model  # noqa: E402


def tiny_config(seed: int = 0, **over) -> ModelConfig:
    """A random tiny GDN shape; GVA, gating and conv options vary with the seed."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    H = r(1, 2)
    kw = dict(
        vocab_size=r(20, 60), hidden_size=8 * r(2, 4), num_hidden_layers=r(1, 3), intermediate_size=8 * r(2, 6),
        num_heads=H, num_v_heads=H * r(1, 2), head_dim=4 * r(1, 2), head_v_dim=4 * r(1, 3),
        use_gate=bool(r(0, 3)), use_short_conv=bool(r(0, 3)), allow_neg_eigval=bool(r(0, 1)),
        gate_activation="sigmoid" if r(0, 3) == 0 else "silu", tie_word_embeddings=bool(r(0, 1)),
        max_position_embeddings=512,
    )
    kw.update(over)
    return ModelConfig(**kw)


def random_model(cfg: ModelConfig, seed: int = 0, dtype=torch.float64) -> Model:
    """Weights large enough that logits are far from ties, so greedy choices are well defined."""
    torch.manual_seed(seed)
    m = Model(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.5 * p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
        for mod in m.modules():
            if isinstance(mod, GatedDeltaNet):
                mod.A_log.uniform_(-2, 1)
                mod.dt_bias.normal_(0, 1)
    return m.to(dtype).eval()


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """fla's Triton kernels on CPU: interpreter on, autotuner benchmarking stubbed (DESIGN §8)."""
    from triton.runtime import autotuner

    monkeypatch.setattr(autotuner.Autotuner, "do_bench", lambda self, *a, **k: [1.0, 1.0, 1.0], raising=False)
    yield
