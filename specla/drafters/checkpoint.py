"""Drafter directories: config.json (the drafter's `model_type` and its config's fields) and
model.safetensors (the drafter's own weights: the target's embedding and LM head are shared,
never saved). The EAGLE drafter (`eagle.py`) and the block drafters (`blocks.py`) are stored so."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from specla.errors import CheckpointError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def save(model, model_type: str, out_dir, dtype: torch.dtype | None = None) -> Path:
    """Write `model` (its `cfg` a dataclass) as a drafter directory, floating weights in `dtype`
    when given."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps({"model_type": model_type, **dataclasses.asdict(model.cfg)}, indent=2) + "\n")
    sd = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in model.state_dict().items()}
    save_file(sd, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def read_config(path, configs: dict[str, type], what: str) -> tuple[str, object]:
    """(model_type, config) of a drafter directory; configs: model_type -> config class, the kinds
    accepted; what: the kind of drafter, as errors name it."""
    path = Path(path)
    try:
        d = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read the drafter config in {path}: {e}") from None
    kind = d.pop("model_type", None)
    if kind not in configs:
        raise CheckpointError(f"{path} is not a specla {what} (model_type {' or '.join(map(repr, configs))} expected)")
    try:
        return kind, configs[kind](**d)
    except TypeError as e:
        raise CheckpointError(f"{path / CONFIG}: {e}") from None


def load_weights(path, model_cls, cfg, device, dtype: torch.dtype):
    """model_cls(cfg) with the directory's weights (names and shapes checked), on `device`,
    floating weights in `dtype`, in eval mode."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        sd = load_file(str(path / WEIGHTS))
    except OSError as e:
        raise CheckpointError(f"cannot read drafter weights in {path}: {e}") from None
    with torch.device("meta"):
        model = model_cls(cfg)
    expected = model.state_dict()
    if set(sd) != set(expected):
        diff = sorted(set(sd) ^ set(expected))
        raise CheckpointError(f"{path / WEIGHTS} does not match its config (e.g. {diff[0]})")
    for name, t in expected.items():
        if tuple(sd[name].shape) != tuple(t.shape):
            raise CheckpointError(f"drafter weight {name} has shape {tuple(sd[name].shape)}, expected {tuple(t.shape)}")
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, assign=True)
    return model.to(device).eval()


def holds_drafter(path) -> bool:
    """Whether `path` is a drafter directory (both files present)."""
    path = Path(path)
    return (path / CONFIG).is_file() and (path / WEIGHTS).is_file()
