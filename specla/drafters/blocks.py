"""Block-drafter checkpoints: a DSpark or ReaDy drafter directory (`drafters.checkpoint`), and
the drafters a target checkpoint carries in `<target>/dspark/`, `<target>/ready/`,
`<target>/dspark-ft/`."""

from __future__ import annotations

from pathlib import Path

import torch

from specla.drafters import checkpoint, dspark, ready
from specla.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel
from specla.drafters.ready import ReadyConfig, ReadyDrafter, ReadyModel
from specla.errors import CheckpointError
from specla.model import Model

DSPARK_DIR = "dspark"  # a target checkpoint's DSpark drafter lives in <target>/dspark/
# model_type -> (config class, model class)
CLASSES = {dspark.MODEL_TYPE: (DSparkConfig, DSparkModel), ready.MODEL_TYPE: (ReadyConfig, ReadyModel)}


def save_block_drafter(model: DSparkModel, out_dir, dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a block-drafter directory (`drafters.checkpoint`)."""
    return checkpoint.save(model, model.model_type, out_dir, dtype)


def load_block_drafter(path, target: Model | None = None, device="cpu", dtype=torch.float32,
                       expect: str | None = None) -> DSparkModel:
    """Load a DSpark or ReaDy drafter directory; with `target`, check it fits and take its device
    and dtype. `expect`: the model_type required."""
    kind, cfg = checkpoint.read_config(path, {k: v[0] for k, v in CLASSES.items()}, "block drafter")
    if expect is not None and kind != expect:
        raise CheckpointError(f"{path} holds a {kind} drafter, {expect} expected")
    if target is not None:
        cfg.check(target.cfg)
        device, dtype = target.device, target.dtype
    return checkpoint.load_weights(path, CLASSES[kind][1], cfg, device, dtype)


def find_block_drafter(model_dir, name: str = DSPARK_DIR) -> Path | None:
    """<model_dir>/<name>/ if it holds a drafter (name: "dspark", "ready", "dspark-ft", ...)."""
    path = Path(model_dir) / name
    return path if checkpoint.holds_drafter(path) else None


def block_drafter(path, target: Model, expect: str | None = None, **options) -> DSparkDrafter:
    """The drafter of a block-drafter directory for `target`: a `ReadyDrafter` for a ReaDy model,
    a `DSparkDrafter` for a DSpark one (options: theirs); `expect` as `load_block_drafter`."""
    model = load_block_drafter(path, target, expect=expect)
    return (ReadyDrafter if isinstance(model, ReadyModel) else DSparkDrafter)(model, target, **options)
