"""Block-drafter checkpoints: a DSpark or ReaDy drafter directory (config.json + model.safetensors,
the drafter's own weights only: the target's embedding and LM head are shared, never saved), and
the drafters a target checkpoint carries in `<target>/dspark/`, `<target>/ready/`,
`<target>/dspark-ft/`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from specla.drafters import dspark, ready
from specla.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel
from specla.drafters.ready import ReadyConfig, ReadyDrafter, ReadyModel
from specla.errors import CheckpointError
from specla.model import Model

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
DSPARK_DIR = "dspark"  # a target checkpoint's DSpark drafter lives in <target>/dspark/
# model_type -> (config class, model class)
CLASSES = {dspark.MODEL_TYPE: (DSparkConfig, DSparkModel), ready.MODEL_TYPE: (ReadyConfig, ReadyModel)}


def save_block_drafter(model: DSparkModel, out_dir, dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a block-drafter directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps({"model_type": model.model_type, **dataclasses.asdict(model.cfg)},
                                         indent=2) + "\n")
    sd = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in model.state_dict().items()}
    save_file(sd, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def read_config(path) -> tuple[str, object]:
    """(model_type, config) of a block drafter directory."""
    path = Path(path)
    try:
        d = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read the drafter config in {path}: {e}") from None
    kind = d.pop("model_type", None)
    if kind not in CLASSES:
        raise CheckpointError(f"{path} is not a specla block drafter (model_type one of {', '.join(CLASSES)} expected)")
    try:
        return kind, CLASSES[kind][0](**d)
    except TypeError as e:
        raise CheckpointError(f"{path / CONFIG}: {e}") from None


def load_block_drafter(path, target: Model | None = None, device="cpu", dtype=torch.float32,
                       expect: str | None = None) -> DSparkModel:
    """Load a DSpark or ReaDy drafter directory; with `target`, check it fits and take its device
    and dtype. `expect`: the model_type required."""
    from safetensors.torch import load_file

    path = Path(path)
    kind, cfg = read_config(path)
    if expect is not None and kind != expect:
        raise CheckpointError(f"{path} holds a {kind} drafter, {expect} expected")
    if target is not None:
        cfg.check(target.cfg)
        device, dtype = target.device, target.dtype
    try:
        sd = load_file(str(path / WEIGHTS))
    except OSError as e:
        raise CheckpointError(f"cannot read drafter weights in {path}: {e}") from None
    with torch.device("meta"):
        model = CLASSES[kind][1](cfg)
    expected = model.state_dict()
    if set(sd) != set(expected):
        diff = sorted(set(sd) ^ set(expected))
        raise CheckpointError(f"{path / WEIGHTS} does not match its config (e.g. {diff[0]})")
    for name, t in expected.items():
        if tuple(sd[name].shape) != tuple(t.shape):
            raise CheckpointError(f"drafter weight {name} has shape {tuple(sd[name].shape)}, expected {tuple(t.shape)}")
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, assign=True)
    return model.to(device).eval()


def find_block_drafter(model_dir, name: str = DSPARK_DIR) -> Path | None:
    """<model_dir>/<name>/ if it holds a drafter (name: "dspark", "ready", "dspark-ft", ...)."""
    path = Path(model_dir) / name
    return path if (path / CONFIG).is_file() and (path / WEIGHTS).is_file() else None


def block_drafter(path, target: Model, expect: str | None = None, **options) -> DSparkDrafter:
    """The drafter of a block-drafter directory for `target`: a `ReadyDrafter` for a ReaDy model,
    a `DSparkDrafter` for a DSpark one (options: theirs); `expect` as `load_block_drafter`."""
    model = load_block_drafter(path, target, expect=expect)
    return (ReadyDrafter if isinstance(model, ReadyModel) else DSparkDrafter)(model, target, **options)
