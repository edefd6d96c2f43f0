"""specla: exact speculative decoding for Gated DeltaNet language models.

`specla.load(model_dir=None, device="auto", dtype="auto", compile=None)` returns a `SpecLA`
(`specla.api`) whose `generate` / `stream` / `verify` run a checkpoint directory.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # imported on first use: `import specla` stays light (the CLI's --help, version checks)
    if name in ("load", "SpecLA", "Generation"):
        from specla import api

        return getattr(api, name)
    raise AttributeError(f"module 'specla' has no attribute {name!r}")
