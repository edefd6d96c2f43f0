"""Named model shapes for benchmarks (DESIGN §6), built with random weights."""

from __future__ import annotations

import dataclasses
import math

import torch

from specla.config import ATTENTION, GDN, ModelConfig
from specla.errors import InputError

SHAPES: dict[str, ModelConfig] = {
    # The paper's kernel shape: 2 MiB fp32 state per layer.
    "gdn-1.3b-paper": ModelConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=24, intermediate_size=5632,
        num_heads=8, num_v_heads=8, head_dim=256, head_v_dim=256, max_position_embeddings=8192),
    # fla's default GatedDeltaNet 1.3B layout (expand_v = 2).
    "gdn-1.3b-fla": ModelConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=21, intermediate_size=5632,
        num_heads=6, num_v_heads=6, head_dim=256, head_v_dim=512, max_position_embeddings=8192),
    # One gated softmax-attention layer in four (Qwen3-Next style), otherwise the paper shape.
    "gdn-1.3b-paper-hybrid": ModelConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=24, intermediate_size=5632,
        num_heads=8, num_v_heads=8, head_dim=256, head_v_dim=256, max_position_embeddings=8192,
        layer_types=[ATTENTION if i % 4 == 3 else GDN for i in range(24)],
        attn_num_heads=16, attn_num_kv_heads=2, attn_head_dim=128, attn_output_gate=True,
        partial_rotary_factor=0.25, rope_theta=10000.0, norm_style="zero_centered",
        source_format="qwen3_5"),
    # Tiny shapes for CPU smoke runs of the benchmark scripts.
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_heads=2, num_v_heads=4, head_dim=16, head_v_dim=16, max_position_embeddings=4096),
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise InputError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    return dataclasses.replace(SHAPES[name], layer_types=list(SHAPES[name].layer_types))


def random_model(name_or_cfg, device="cpu", dtype=torch.bfloat16, seed: int = 0):
    """A model of the named shape with random weights scaled like a trained one."""
    from specla.model import GatedDeltaNet, Model

    cfg = shape_config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("o_norm_weight"):
                p.fill_(0.0 if cfg.norm_style == "zero_centered" and not name.endswith("o_norm_weight") else 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        for m in model.modules():
            if isinstance(m, GatedDeltaNet):
                # fla's initialisation: A ~ U(1, 16), dt log-uniform in [1e-3, 1e-1]
                m.A_log.copy_(torch.empty(m.HV, device=device).uniform_(1, 16, generator=gen).log())
                dt = torch.exp(torch.rand(m.HV, device=device, generator=gen) * math.log(100) + math.log(1e-3))
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return model.to(dtype).eval()
