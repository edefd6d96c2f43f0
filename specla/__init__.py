"""specla: exact speculative decoding for Gated DeltaNet language models."""

__version__ = "0.1.0"
