"""Checkpoint directories: config.json + safetensors (single file or sharded with an index).

Each supported format translates its config into a `ModelConfig` and its weight names into the
canonical ones of `specla.model.Model`; saving writes the fla `GatedDeltaNetForCausalLM`
format, so fla itself can load what specla saves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specla import hybrid_formats
from specla.config import ModelConfig, from_fla_dict, load_config_dict, to_fla_dict
from specla.errors import CheckpointError
from specla.model import Model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Format:
    name: str
    config: Callable[[dict], ModelConfig]
    to_canonical: Callable[[dict, ModelConfig], dict]  # checkpoint names -> Model names


# fla GatedDeltaNetForCausalLM ----------------------------------------------------------------

def _fla_to_canonical(sd: dict, cfg: ModelConfig) -> dict:
    out = {"embeddings.weight": sd.pop("model.embeddings.weight"), "norm.weight": sd.pop("model.norm.weight")}
    if "lm_head.weight" in sd:
        out["lm_head.weight"] = sd.pop("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + "attn."
        names = ["q_proj", "k_proj", "v_proj"] + (["g_proj"] if cfg.use_gate else []) + ["a_proj", "b_proj"]
        out[q + "mixer.in_proj.weight"] = torch.cat([sd.pop(f"{a}{n}.weight") for n in names], 0)
        if cfg.use_short_conv:
            out[q + "mixer.conv_weight"] = torch.cat(
                [sd.pop(f"{a}{n}_conv1d.weight").squeeze(1) for n in ("q", "k", "v")], 0)
        for n in ("A_log", "dt_bias"):
            out[q + "mixer." + n] = sd.pop(a + n)
        out[q + "mixer.o_norm_weight"] = sd.pop(a + "o_norm.weight")
        out[q + "mixer.o_proj.weight"] = sd.pop(a + "o_proj.weight")
        for n in ("attn_norm", "mlp_norm"):
            out[f"{q}{n}.weight"] = sd.pop(f"{p}{n}.weight")
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{q}mlp.{n}.weight"] = sd.pop(f"{p}mlp.{n}.weight")
    if sd:
        raise CheckpointError(f"checkpoint has unexpected weights: {', '.join(sorted(sd)[:5])}")
    return out


def _canonical_to_fla(sd: dict, cfg: ModelConfig) -> dict:
    out = {"model.embeddings.weight": sd["embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + "attn."
        names = ["q_proj", "k_proj", "v_proj"] + (["g_proj"] if cfg.use_gate else []) + ["a_proj", "b_proj"]
        sizes = [cfg.key_dim, cfg.key_dim, cfg.value_dim] + ([cfg.value_dim] if cfg.use_gate else []) \
            + [cfg.num_v_heads, cfg.num_v_heads]
        for n, w in zip(names, torch.split(sd[q + "mixer.in_proj.weight"], sizes, 0)):
            out[f"{a}{n}.weight"] = w
        if cfg.use_short_conv:
            parts = torch.split(sd[q + "mixer.conv_weight"], [cfg.key_dim, cfg.key_dim, cfg.value_dim], 0)
            for n, w in zip(("q", "k", "v"), parts):
                out[f"{a}{n}_conv1d.weight"] = w.unsqueeze(1)
        for n in ("A_log", "dt_bias"):
            out[a + n] = sd[q + "mixer." + n]
        out[a + "o_norm.weight"] = sd[q + "mixer.o_norm_weight"]
        out[a + "o_proj.weight"] = sd[q + "mixer.o_proj.weight"]
        for n in ("attn_norm", "mlp_norm"):
            out[f"{p}{n}.weight"] = sd[f"{q}{n}.weight"]
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{n}.weight"] = sd[f"{q}mlp.{n}.weight"]
    return {k: v.contiguous() for k, v in out.items()}


FORMATS: dict[str, Format] = {"gated_deltanet": Format("fla", from_fla_dict, _fla_to_canonical),
                               **{k: Format(*v) for k, v in hybrid_formats.FORMATS.items()}}


def _format_for(d: dict) -> Format:
    mt = d.get("model_type")
    if mt not in FORMATS:
        known = ", ".join(sorted(FORMATS))
        arch = ", ".join(d.get("architectures") or []) or "unknown"
        raise CheckpointError(f"unsupported architecture {arch} (model_type={mt!r}); specla loads: {known}")
    return FORMATS[mt]


# reading / writing ---------------------------------------------------------------------------

def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            sd = {}
            for shard in sorted(set(weight_map.values())):
                path = model_dir / shard
                if not path.is_file():
                    raise CheckpointError(f"{model_dir} is missing shard {shard} listed in {INDEX}")
                part = load_file(str(path))
                sd.update(part)
            missing = sorted(set(weight_map) - set(sd))
            if missing:
                raise CheckpointError(f"{INDEX} lists weights no shard contains: {', '.join(missing[:5])}")
            return sd
        if (model_dir / SINGLE).is_file():
            return load_file(str(model_dir / SINGLE))
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read weights in {model_dir}: {e}") from None
    raise CheckpointError(f"{model_dir} has no {SINGLE} or {INDEX}")


def _keys_by_file(model_dir: Path) -> dict[str, list[str]] | None:
    """The tensor names each safetensors file of a checkpoint directory holds (from the index, or
    the single file's header; no tensor is read); None when the directory has neither."""
    from safetensors import safe_open

    if (model_dir / INDEX).is_file():
        files: dict[str, list[str]] = {}
        for k, f in (json.loads((model_dir / INDEX).read_text()).get("weight_map") or {}).items():
            files.setdefault(f, []).append(k)
        return files
    if (model_dir / SINGLE).is_file():
        with safe_open(str(model_dir / SINGLE), "pt") as fh:
            return {SINGLE: list(fh.keys())}
    return None


def read_mtp_state_dict(model_dir) -> dict[str, torch.Tensor]:
    """Only the `mtp.*` tensors of a checkpoint directory (reads just the shards holding them)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = _keys_by_file(model_dir)
    if files is None:
        raise CheckpointError(f"{model_dir} has no {SINGLE} or {INDEX}")
    sd = {}
    for f, keys in files.items():
        keys = [k for k in keys if k.startswith("mtp.")]
        if keys:
            with safe_open(str(model_dir / f), "pt") as fh:
                for k in keys:
                    sd[k] = fh.get_tensor(k)
    return sd


def has_mtp(model_dir) -> bool:
    """Whether a checkpoint directory carries `mtp.*` weights (without reading any tensor)."""
    files = _keys_by_file(Path(model_dir)) or {}
    return any(k.startswith("mtp.") for keys in files.values() for k in keys)


def load_config(model_dir) -> ModelConfig:
    d = load_config_dict(Path(model_dir))
    return _format_for(d).config(d)


def load_model(model_dir, device="cpu", dtype=torch.float32) -> Model:
    """Build the model described by `model_dir/config.json` and load its weights."""
    model_dir = Path(model_dir)
    d = load_config_dict(model_dir)
    fmt = _format_for(d)
    cfg = fmt.config(d)
    try:
        sd = fmt.to_canonical(read_state_dict(model_dir), cfg)
    except KeyError as e:
        raise CheckpointError(f"{model_dir} is missing weight {e.args[0]}") from None
    with torch.device("meta"):
        model = Model(cfg)
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(f"{model_dir} is missing weights: {', '.join(missing[:5])}"
                              + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    extra = sorted(set(sd) - set(expected))
    if extra:
        raise CheckpointError(f"{model_dir} has unexpected weights: {', '.join(extra[:5])}")
    for name, t in expected.items():
        if tuple(sd[name].shape) != tuple(t.shape):
            raise CheckpointError(
                f"weight {name} has shape {tuple(sd[name].shape)} but config.json implies {tuple(t.shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    return model.to(device).eval()


def save_model(model: Model, out_dir, max_shard_bytes: int = 15 * 2**20, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and safetensors shards (each under `max_shard_bytes`) in fla's format."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    sd = {k: (v.to(dtype) if dtype else v).detach().cpu() for k, v in model.state_dict().items()}
    sd = _canonical_to_fla(sd, cfg)
    (out / "config.json").write_text(json.dumps(to_fla_dict(cfg), indent=2) + "\n")
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(sd):
        nbytes = sd[name].numel() * sd[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = sd[name]
        size += nbytes
    for old in list(out.glob("model*.safetensors")) + [out / INDEX]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
        return out
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out
