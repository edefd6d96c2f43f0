"""Token streams for training: a corpus split tokenised once into a flat uint16 array."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def tokenize_split(corpus_dir: Path, split: str, tokenizer, cache: Path, progress: bool = True) -> np.ndarray:
    """All documents of a split, tokenised and concatenated (each already carries its
    bos/eos markers). Cached as .npy next to the run, since tokenising takes a minute."""
    from tqdm import tqdm

    from specla.data.corpus import iter_records

    cache = Path(cache)
    if cache.is_file():
        return np.load(cache, mmap_mode="r")
    texts = [r["text"] for r in iter_records(corpus_dir, split)]
    ids: list[np.ndarray] = []
    batch = 512
    for i in tqdm(range(0, len(texts), batch), desc=f"tokenising {split}", disable=not progress, unit="batch"):
        for enc in tokenizer.tokenizer.encode_batch(texts[i:i + batch], add_special_tokens=False):
            ids.append(np.asarray(enc.ids, dtype=np.uint16))
    flat = np.concatenate(ids)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + ".tmp.npy")
    np.save(tmp, flat)
    tmp.replace(cache)  # readers never see a partial file
    return flat


class Batches:
    """Random windows of seq_len + 1 tokens; batch i depends only on (seed, i), so a resumed
    run continues the exact sequence of batches, and each rank draws its own slice."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, rank: int = 0, world: int = 1):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus split has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
        self.tokens, self.bs, self.T, self.seed, self.rank, self.world = tokens, batch_size, seq_len, seed, rank, world

    def get(self, step: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, step, self.rank])
        starts = rng.integers(0, len(self.tokens) - self.T - 1, size=self.bs)
        return torch.from_numpy(np.stack([self.tokens[s:s + self.T + 1] for s in starts]).astype(np.int64))
