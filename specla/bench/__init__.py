"""Benchmarks (`specla bench ...`); each module has a `run(...) -> dict` entry point."""
