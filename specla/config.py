"""Model configuration: one dataclass for every target specla runs.

Checkpoint formats (fla `gated_deltanet`, HF Qwen3-Next / Qwen3.5) are translated into this
canonical form by `specla.checkpoint`; the model code only ever sees a `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from specla.errors import CheckpointError, UnsupportedConfigError

GDN = "linear_attention"
ATTENTION = "full_attention"


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    # Gated DeltaNet mixer (DESIGN §1); H key heads, HV value heads (GVA when HV > H).
    num_heads: int
    num_v_heads: int
    head_dim: int
    head_v_dim: int
    conv_size: int = 4
    use_short_conv: bool = True
    conv_bias: bool = False
    use_gate: bool = True
    gate_activation: str = "silu"  # output gate of the GDN mixer: silu or sigmoid
    allow_neg_eigval: bool = False
    norm_eps: float = 1e-6
    # "plain": y = w * x / rms(x); "zero_centered": y = (1 + w) * x / rms(x) (Qwen3-Next / Qwen3.5)
    norm_style: str = "plain"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    # Hybrid stacks: one entry per layer, GDN or ATTENTION.
    layer_types: list[str] = field(default_factory=list)
    # Softmax attention (hybrid layers only).
    attn_num_heads: int = 0
    attn_num_kv_heads: int = 0
    attn_head_dim: int = 0
    attn_output_gate: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    # Sparse MoE MLP (Qwen3-Next); num_experts == 0 means every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1
    # Multi-token-prediction module layers shipped with the checkpoint (Qwen3-Next / Qwen3.5).
    mtp_num_layers: int = 0
    # Where the config came from; decides weight names when saving.
    source_format: str = "fla"

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [GDN] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(
                f"config lists {len(self.layer_types)} layer types for {self.num_hidden_layers} layers"
            )
        if self.num_v_heads % self.num_heads:
            raise CheckpointError(f"num_v_heads={self.num_v_heads} is not a multiple of num_heads={self.num_heads}")
        if self.gate_activation not in ("silu", "sigmoid"):
            raise UnsupportedConfigError(f"GDN output gate activation {self.gate_activation!r} is not supported")

    # Derived sizes -----------------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == GDN]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == ATTENTION]

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# fla ---------------------------------------------------------------------------------------

# Options of fla's GatedDeltaNetConfig that only change training kernels, not the function.
_FLA_NUMERICALLY_NEUTRAL = {
    "attn_mode", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy",
    "use_l2warp", "use_cache", "initializer_range",
}


def fla_intermediate_size(hidden_size: int, hidden_ratio: float | None, intermediate_size: int | None) -> int:
    """fla's GatedMLP rounds 2/3 * hidden * ratio up to a multiple of 256."""
    if intermediate_size is not None:
        return int(intermediate_size)
    ratio = 4 if hidden_ratio is None else hidden_ratio
    size = int(hidden_size * ratio * 2 / 3)
    return 256 * ((size + 255) // 256)


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def from_fla_dict(d: dict) -> ModelConfig:
    """Translate an fla 0.6.0 `GatedDeltaNetConfig` dict; refuse what specla does not run, by name."""
    if d.get("attn") is not None:
        raise UnsupportedConfigError(
            "fla config option 'attn' (softmax-attention layers inside a GatedDeltaNet model) is not "
            "supported; hybrid targets are supported in the Qwen3-Next / Qwen3.5 checkpoint formats"
        )
    if d.get("attnres_block_size") is not None:
        raise UnsupportedConfigError("fla config option 'attnres_block_size' (attention residuals) is not supported")
    if d.get("hidden_act", "swish") != "swish":
        raise UnsupportedConfigError(f"fla config option hidden_act={d['hidden_act']!r} is not supported (only 'swish')")
    if d.get("conv_bias"):
        # fla's GatedDeltaNetBlock never passes conv_bias; a config carrying it came from elsewhere.
        raise UnsupportedConfigError("fla config option 'conv_bias' is not supported")
    hidden = int(d.get("hidden_size", 2048))
    head_dim = int(d.get("head_dim", 256))
    num_heads = int(d.get("num_heads", 6))
    num_v_heads = d.get("num_v_heads") or num_heads
    expand_v = float(d.get("expand_v", 2.0))
    head_v_dim = head_dim * expand_v
    if not math.isclose(head_v_dim, round(head_v_dim), rel_tol=1e-6):
        raise CheckpointError(f"expand_v={expand_v} times head_dim={head_dim} is not an integer")
    act = d.get("output_gate_activation", "swish")
    return ModelConfig(
        vocab_size=int(d.get("vocab_size", 32000)),
        hidden_size=hidden,
        num_hidden_layers=int(d.get("num_hidden_layers", 21)),
        intermediate_size=fla_intermediate_size(hidden, d.get("hidden_ratio", 4), d.get("intermediate_size")),
        num_heads=num_heads,
        num_v_heads=int(num_v_heads),
        head_dim=head_dim,
        head_v_dim=int(round(head_v_dim)),
        conv_size=int(d.get("conv_size", 4)),
        use_short_conv=bool(d.get("use_short_conv", True)),
        use_gate=bool(d.get("use_gate", True)),
        gate_activation="sigmoid" if act == "sigmoid" else "silu",
        allow_neg_eigval=bool(d.get("allow_neg_eigval", False)),
        norm_eps=float(d.get("norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_eos_list(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
        source_format="fla",
    )


def to_fla_dict(cfg: ModelConfig) -> dict:
    """The config.json fla's `GatedDeltaNetForCausalLM.from_pretrained` reads back."""
    if cfg.attention_layers or cfg.num_experts or cfg.norm_style != "plain":
        raise UnsupportedConfigError("only pure-GDN models with fla-style norms can be saved in the fla format")
    return {
        "architectures": ["GatedDeltaNetForCausalLM"],
        "model_type": "gated_deltanet",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size,
        "hidden_ratio": 4,
        "hidden_act": "swish",
        "num_heads": cfg.num_heads,
        "num_v_heads": cfg.num_v_heads,
        "head_dim": cfg.head_dim,
        "expand_v": cfg.head_v_dim / cfg.head_dim,
        "conv_size": cfg.conv_size,
        "use_short_conv": cfg.use_short_conv,
        "use_gate": cfg.use_gate,
        "output_gate_activation": "sigmoid" if cfg.gate_activation == "sigmoid" else "swish",
        "allow_neg_eigval": cfg.allow_neg_eigval,
        "norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "attn": None,
        "fuse_norm": True,
        "fuse_swiglu": True,
        "fuse_cross_entropy": True,
    }


def load_config_dict(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
