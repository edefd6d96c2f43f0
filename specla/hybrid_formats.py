"""HF Qwen3-Next / Qwen3.5 checkpoints (transformers 5.x layout) -> specla's canonical model.

`FORMATS` (which `specla.checkpoint` registers) is keyed by the `model_type` transformers writes:

    qwen3_next        Qwen3NextForCausalLM     GDN (fused in_proj_qkvz / in_proj_ba) + attention, MoE / dense MLPs
    qwen3_5_text      Qwen3_5ForCausalLM       GDN (split in_proj_qkv / _z / _b / _a) + attention, dense MLPs
    qwen3_5           Qwen3_5ForConditionalGeneration config: its text_config, text weights only
    qwen3_5_moe_text  Qwen3_5MoeForCausalLM    as qwen3_5_text with MoE MLPs in every layer
    qwen3_5_moe       multimodal config of the above: its text_config, text weights only

What specla does not run is refused by name (`UnsupportedConfigError`); see docs/hybrid.md.
`mtp.*` weights (multi-token prediction) are not part of the target: `specla.drafters.mtp`
reads them with `checkpoint.read_mtp_state_dict` and converts them with `mtp_to_canonical`.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from specla.config import ATTENTION, GDN, ModelConfig, _eos_list
from specla.errors import CheckpointError, UnsupportedConfigError


def _refuse(fmt: str, option: str, why: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{fmt} config option {option}: {why}")


def _rope(d: dict, fmt: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor); only plain RoPE (text positions) is supported."""
    rp = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if isinstance(rp, dict):
        params = dict(rp)
    else:
        params = {"rope_type": "default"}
        if isinstance(scaling, dict):
            params.update(scaling)
    rtype = params.get("rope_type", params.get("type", "default"))
    # Qwen3.5's interleaved M-RoPE reduces to plain RoPE when the temporal, height and width
    # positions are equal, which they are for text.
    if rtype not in ("default", None):
        raise _refuse(fmt, f"rope_type={rtype!r}", "RoPE scaling is not supported (only plain RoPE)")
    extra = set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section",
                           "mrope_interleaved"}
    if extra:
        raise _refuse(fmt, f"rope_parameters.{sorted(extra)[0]}", "unknown RoPE parameter")
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    prf = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    if not 0 < prf <= 1:
        raise _refuse(fmt, f"partial_rotary_factor={prf}", "must be in (0, 1]")
    return theta, prf


def _check_options(d: dict, fmt: str) -> None:
    if d.get("use_sliding_window") or (d.get("sliding_window") is not None and "use_sliding_window" not in d):
        raise _refuse(fmt, "sliding_window", "sliding-window attention is not supported (full causal attention only)")
    if d.get("attention_bias"):
        raise _refuse(fmt, "attention_bias=true", "biases in the attention projections are not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise _refuse(fmt, f"hidden_act={d['hidden_act']!r}", "only 'silu' MLPs are supported")
    if d.get("layer_scale"):
        raise _refuse(fmt, "layer_scale", "per-layer output scales are not supported")
    if d.get("attn_output_gate") is False:
        raise _refuse(fmt, "attn_output_gate=false",
                      "transformers always applies the attention output gate for this architecture")
    if d.get("quantization_config"):
        raise _refuse(fmt, "quantization_config", "quantised checkpoints are not supported; use bf16/fp32 weights")


def _layer_types(d: dict, n: int, fmt: str) -> list[str]:
    lt = d.get("layer_types")
    if lt is None:
        interval = int(d.get("full_attention_interval", 4))
        lt = [GDN if (i + 1) % interval else ATTENTION for i in range(n)]
    lt = list(lt)
    bad = sorted({t for t in lt if t not in (GDN, ATTENTION)})
    if bad:
        raise _refuse(fmt, f"layer_types={bad[0]!r}",
                      f"specla runs only {GDN!r} (Gated DeltaNet) and {ATTENTION!r} layers")
    if len(lt) != n:
        raise CheckpointError(f"config lists {len(lt)} layer types for {n} layers")
    return lt


def _text_config(d: dict, fmt: str) -> dict:
    """Multimodal Qwen3.5 configs: the language model's config (vision weights are refused on load)."""
    tc = d.get("text_config")
    if not isinstance(tc, dict):
        raise CheckpointError(f"{fmt} config has no text_config")
    out = dict(tc)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
        if key in d and (key == "tie_word_embeddings" or out.get(key) is None):
            out[key] = d[key]
    out["architectures"] = d.get("architectures")
    return out


def _config(d: dict, fmt: str, moe: str) -> ModelConfig:
    """moe: 'sparse_step' (Qwen3-Next: mlp_only_layers / decoder_sparse_step), 'all' or 'none'."""
    _check_options(d, fmt)
    n = int(d["num_hidden_layers"])
    theta, prf = _rope(d, fmt)
    hidden = int(d["hidden_size"])
    heads = int(d["num_attention_heads"])
    kw = dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=n,
        intermediate_size=int(d.get("intermediate_size") or 0),
        num_heads=int(d.get("linear_num_key_heads", 16)),
        num_v_heads=int(d.get("linear_num_value_heads", 32)),
        head_dim=int(d.get("linear_key_head_dim", 128)),
        head_v_dim=int(d.get("linear_value_head_dim", 128)),
        conv_size=int(d.get("linear_conv_kernel_dim", 4)),
        use_short_conv=True,
        conv_bias=False,
        use_gate=True,
        gate_activation="silu",
        allow_neg_eigval=False,
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        norm_style="zero_centered",
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_eos_list(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
        layer_types=_layer_types(d, n, fmt),
        attn_num_heads=heads,
        attn_num_kv_heads=int(d.get("num_key_value_heads", heads)),
        attn_head_dim=int(d.get("head_dim") or hidden // heads),
        attn_output_gate=True,
        rope_theta=theta,
        partial_rotary_factor=prf,
        mtp_num_layers=int(d.get("mtp_num_hidden_layers", d.get("num_nextn_predict_layers", 0)) or 0),
        source_format=fmt,
    )
    if "gdn_norm_eps" in {f.name for f in dataclasses.fields(ModelConfig)}:
        kw["gdn_norm_eps"] = kw["norm_eps"]  # the gated norm uses rms_norm_eps too
    if moe != "none" and int(d.get("num_experts", 0) or 0) > 0:
        kw.update(
            num_experts=int(d["num_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            mlp_only_layers=[int(i) for i in (d.get("mlp_only_layers") or [])] if moe == "sparse_step" else [],
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1) if moe == "sparse_step" else 1,
        )
    cfg = ModelConfig(**kw)
    dense = [i for i in range(n) if not cfg.is_moe_layer(i)]
    if dense and cfg.intermediate_size <= 0:
        raise CheckpointError(f"{fmt} config: layers {dense[:4]} have dense MLPs but intermediate_size is missing")
    return cfg


def qwen3_next_config(d: dict) -> ModelConfig:
    return _config(d, "qwen3_next", moe="sparse_step")


def qwen3_5_text_config(d: dict) -> ModelConfig:
    return _config(d, "qwen3_5", moe="none")


def qwen3_5_config(d: dict) -> ModelConfig:
    return _config(_text_config(d, "qwen3_5"), "qwen3_5", moe="none")


def qwen3_5_moe_text_config(d: dict) -> ModelConfig:
    return _config(d, "qwen3_5_moe", moe="all")


def qwen3_5_moe_config(d: dict) -> ModelConfig:
    return _config(_text_config(d, "qwen3_5_moe"), "qwen3_5_moe", moe="all")


# weights ----------------------------------------------------------------------------------

def _take(sd: dict, name: str) -> torch.Tensor:
    if name not in sd:
        raise KeyError(name)
    return sd.pop(name)


def gdn_in_proj_from_qkvz_ba(qkvz: torch.Tensor, ba: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Qwen3-Next's per-key-head interleaved projections -> canonical rows [q | k | v | z | a | b].

    in_proj_qkvz rows come in H groups (one per key head h) of [q_h (dk) | k_h (dk) |
    v of value heads h*r .. h*r+r-1 (r*dv) | z of the same heads (r*dv)], r = HV / H;
    in_proj_ba rows in H groups of [b (r) | a (r)] for the same value heads.
    """
    H, r, dk, dv = cfg.num_heads, cfg.num_v_heads // cfg.num_heads, cfg.head_dim, cfg.head_v_dim
    D = qkvz.shape[-1]
    per = 2 * dk + 2 * r * dv
    if qkvz.shape[0] != H * per or ba.shape[0] != H * 2 * r:
        raise CheckpointError(
            f"in_proj_qkvz {tuple(qkvz.shape)} / in_proj_ba {tuple(ba.shape)} do not match the config's "
            f"linear-attention heads ({H} key heads, {H * r} value heads, dims {dk}/{dv})")
    w = qkvz.reshape(H, per, D)
    q, k = w[:, :dk], w[:, dk:2 * dk]
    v, z = w[:, 2 * dk:2 * dk + r * dv], w[:, 2 * dk + r * dv:]
    wba = ba.reshape(H, 2 * r, D)
    b, a = wba[:, :r], wba[:, r:]
    return torch.cat([t.reshape(-1, D) for t in (q, k, v, z, a, b)], 0)


def _gdn(sd, p, q, cfg, style):
    a = p + "linear_attn."
    if style == "next":
        w = gdn_in_proj_from_qkvz_ba(_take(sd, a + "in_proj_qkvz.weight"), _take(sd, a + "in_proj_ba.weight"), cfg)
    else:
        w = torch.cat([_take(sd, f"{a}in_proj_{n}.weight") for n in ("qkv", "z", "a", "b")], 0)
    out = {q + "mixer.in_proj.weight": w}
    out[q + "mixer.conv_weight"] = _take(sd, a + "conv1d.weight").squeeze(1)
    for n in ("A_log", "dt_bias"):
        out[q + "mixer." + n] = _take(sd, a + n)
    out[q + "mixer.o_norm_weight"] = _take(sd, a + "norm.weight")
    out[q + "mixer.o_proj.weight"] = _take(sd, a + "out_proj.weight")
    return out


def attention_in_proj(q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, heads: int) -> torch.Tensor:
    """HF q_proj rows are per head [query (D) | gate (D)]; canonical rows are [q | gate | k | v]."""
    Dh = q_proj.shape[0] // heads // 2
    w = q_proj.reshape(heads, 2 * Dh, -1)
    return torch.cat([w[:, :Dh].reshape(heads * Dh, -1), w[:, Dh:].reshape(heads * Dh, -1), k_proj, v_proj], 0)


def _attn(sd, p, q, cfg):
    a = p + "self_attn."
    out = {q + "mixer.in_proj.weight": attention_in_proj(
        _take(sd, a + "q_proj.weight"), _take(sd, a + "k_proj.weight"), _take(sd, a + "v_proj.weight"),
        cfg.attn_num_heads)}
    for n in ("q_norm", "k_norm", "o_proj"):
        out[f"{q}mixer.{n}.weight"] = _take(sd, f"{a}{n}.weight")
    return out


def _mlp(sd, p, q, moe: bool, num_experts: int):
    m, out = p + "mlp.", {}
    if not moe:
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{q}mlp.{n}.weight"] = _take(sd, f"{m}{n}.weight")
        return out
    out[q + "mlp.router.weight"] = _take(sd, m + "gate.weight")
    if m + "experts.gate_up_proj" in sd:  # transformers 5 fused layout
        out[q + "mlp.experts_gate_up"] = _take(sd, m + "experts.gate_up_proj")
        out[q + "mlp.experts_down"] = _take(sd, m + "experts.down_proj")
    else:  # one module per expert, as published checkpoints store them
        gate = [_take(sd, f"{m}experts.{e}.gate_proj.weight") for e in range(num_experts)]
        up = [_take(sd, f"{m}experts.{e}.up_proj.weight") for e in range(num_experts)]
        down = [_take(sd, f"{m}experts.{e}.down_proj.weight") for e in range(num_experts)]
        out[q + "mlp.experts_gate_up"] = torch.cat([torch.stack(gate), torch.stack(up)], 1)
        out[q + "mlp.experts_down"] = torch.stack(down)
    for n in ("gate_proj", "up_proj", "down_proj"):
        if f"{m}shared_expert.{n}.weight" in sd:
            out[f"{q}mlp.shared_expert.{n}.weight"] = _take(sd, f"{m}shared_expert.{n}.weight")
    if m + "shared_expert_gate.weight" in sd:
        out[q + "mlp.shared_expert_gate.weight"] = _take(sd, m + "shared_expert_gate.weight")
    return out


def convert_layer(sd: dict, p: str, q: str, cfg: ModelConfig, layer_type: str, moe: bool, style: str) -> dict:
    """One decoder layer under checkpoint prefix p -> canonical `Block` names under prefix q."""
    out = _gdn(sd, p, q, cfg, style) if layer_type == GDN else _attn(sd, p, q, cfg)
    out.update(_mlp(sd, p, q, moe, cfg.num_experts))
    out[q + "attn_norm.weight"] = _take(sd, p + "input_layernorm.weight")
    out[q + "mlp_norm.weight"] = _take(sd, p + "post_attention_layernorm.weight")
    return out


_LM_PREFIX = re.compile(r"^model\.language_model\.")


def _normalise_names(sd: dict, fmt: str) -> dict:
    visual = sorted(k for k in sd if k.startswith(("model.visual.", "visual.")))
    if visual:
        raise UnsupportedConfigError(
            f"this {fmt} checkpoint carries a vision tower ({visual[0]}, ...); specla runs text-only "
            f"checkpoints: save the language model alone (e.g. Qwen3_5ForCausalLM) and load that")
    return {_LM_PREFIX.sub("model.", k): v for k, v in sd.items()}


def _to_canonical(sd: dict, cfg: ModelConfig, style: str, fmt: str) -> dict:
    sd = _normalise_names(sd, fmt)
    for k in [k for k in sd if k.startswith("mtp.")]:
        del sd[k]  # the MTP drafter reads these itself
    out = {"embeddings.weight": _take(sd, "model.embed_tokens.weight"), "norm.weight": _take(sd, "model.norm.weight")}
    if "lm_head.weight" in sd:
        out["lm_head.weight"] = sd.pop("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        out.update(convert_layer(sd, f"model.layers.{i}.", f"layers.{i}.", cfg, cfg.layer_types[i],
                                 cfg.is_moe_layer(i), style))
    if sd:
        raise CheckpointError(f"checkpoint has unexpected weights: {', '.join(sorted(sd)[:5])}")
    return out


def qwen3_next_to_canonical(sd: dict, cfg: ModelConfig) -> dict:
    return _to_canonical(sd, cfg, "next", "qwen3_next")


def qwen3_5_to_canonical(sd: dict, cfg: ModelConfig) -> dict:
    return _to_canonical(sd, cfg, "3.5", cfg.source_format)


# MTP --------------------------------------------------------------------------------------

def mtp_layer_count(sd: dict) -> int:
    ids = {int(m.group(1)) for k in sd if (m := re.match(r"^mtp\.layers\.(\d+)\.", k))}
    return max(ids) + 1 if ids else 0


def mtp_to_canonical(sd: dict, cfg: ModelConfig) -> tuple[dict, ModelConfig]:
    """`mtp.*` weights -> (canonical names of `specla.drafters.mtp.MTPModule`, its layer config).

    The layer config is the target's with one full-attention layer; its MLP is sparse when the
    checkpoint has a router for it (Qwen3-Next, Qwen3.5-MoE), dense otherwise (Qwen3.5).
    """
    sd = dict(sd)
    fmt = cfg.source_format
    n = mtp_layer_count(sd)
    if n == 0:
        raise CheckpointError("the checkpoint has no multi-token-prediction weights (mtp.layers.*)")
    if n > 1:
        raise UnsupportedConfigError(f"{fmt}: {n} MTP layers (mtp_num_hidden_layers > 1) are not supported")
    if any(k.startswith("mtp.embed_tokens") for k in sd):
        raise UnsupportedConfigError(f"{fmt} option mtp_use_dedicated_embeddings: MTP embeddings of its own are "
                                     "not supported (the drafter shares the target's)")
    moe = "mtp.layers.0.mlp.gate.weight" in sd
    over = dict(num_hidden_layers=1, layer_types=[ATTENTION], mlp_only_layers=[], decoder_sparse_step=1)
    if moe and cfg.num_experts == 0:
        raise CheckpointError("the MTP layer is sparse but the config has no num_experts")
    if not moe:
        if "mtp.layers.0.mlp.gate_proj.weight" not in sd:
            raise CheckpointError("the checkpoint's MTP layer has no MLP weights")
        over.update(num_experts=0, intermediate_size=int(sd["mtp.layers.0.mlp.gate_proj.weight"].shape[0]))
    mcfg = dataclasses.replace(cfg, **over)
    out = convert_layer(sd, "mtp.layers.0.", "layers.0.", mcfg, ATTENTION, moe, "3.5")
    for n_ in ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"):
        out[n_] = _take(sd, "mtp." + n_)
    if sd:
        raise CheckpointError(f"checkpoint has unexpected MTP weights: {', '.join(sorted(sd)[:5])}")
    return out, mcfg


# model_type -> (format name, config translation, weight-name translation)
FORMATS = {
    "qwen3_next": ("qwen3_next", qwen3_next_config, qwen3_next_to_canonical),
    "qwen3_5_text": ("qwen3_5", qwen3_5_text_config, qwen3_5_to_canonical),
    "qwen3_5": ("qwen3_5", qwen3_5_config, qwen3_5_to_canonical),
    "qwen3_5_moe_text": ("qwen3_5_moe", qwen3_5_moe_text_config, qwen3_5_to_canonical),
    "qwen3_5_moe": ("qwen3_5_moe", qwen3_5_moe_config, qwen3_5_to_canonical),
}
