"""Python API: load a model directory, generate (tokens, text, statistics), stream text.

    import specla
    lm = specla.load("path/to/checkpoint")          # or specla.load() for the demo model
    out = lm.generate("Write a haiku.", route="tree", max_new_tokens=64)
    print(out.text, out.mean_accepted_length)
    for piece in lm.stream("Tell me a story.", route="chain"):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import inspect
import queue
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specla.checkpoint import load_model
from specla.decode import EXACT_WIDTH, Decoder, GenerationResult, Sampling
from specla.drafters.base import Drafter
from specla.drafters.ngram import NgramDrafter
from specla.errors import CheckpointError, InputError
from specla.model import Model
from specla.topology import as_parents

DEMO_DIR = Path(__file__).parent / "models" / "demo"
ROUTES = ("ar", "chain", "tree", "fla", "mtp", "dspark", "ready")
DRAFTERS = ("auto", "eagle", "ngram")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def parse_tree_depth(text: str) -> int | tuple[int, int]:
    """A tree depth as the command line gives it: N (every round's rollout N deep) or
    SHALLOW:DEEP (each round's depth chosen from the last round report read,
    `drafters.tree.DepthPolicy`)."""
    try:
        parts = [int(x) for x in str(text).split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise InputError(f"tree depth {text!r}: expected N or SHALLOW:DEEP (e.g. 8 or 6:10)")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was asked for, but no CUDA GPU is available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class Generation:
    text: str
    tokens: list[int]
    route: str
    rounds: int
    mean_accepted_length: float
    first_token_match: float
    tokens_per_second: float
    prefill_seconds: float
    decode_seconds: float
    stop_reason: str
    prompt_tokens: int

    def to_dict(self) -> dict:
        """JSON-ready: undefined rates (NaN, e.g. no draft rounds) become None."""
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(self).items()}


class TextStream:
    """Incremental detokenisation: hold back a trailing partial UTF-8 character."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: Sequence[int]) -> str:
        self.ids += list(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece


class SpecLA:
    """A loaded target with its tokenizer and drafters."""

    def __init__(self, model: Model, tokenizer, model_dir: Path):
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self._eagle = None  # trained drafter weights, loaded on first use
        # Reused across generate calls: drafters (their graphs) and targets (cache, graphs).
        self._drafters: dict = {}
        self._targets: dict = {}

    @classmethod
    def load(cls, model_dir: str | Path | None = None, device: str = "auto", dtype: str = "auto",
             compile: str | None = None) -> "SpecLA":
        """compile: None (plain path unless SPECLA_COMPILE is set), "default" or "max-autotune":
        the fused decode path (`specla.fused`), and the drafter's graphs compiled with it. The
        first generation then compiles (a minute or two on a GPU; cached on disk after)."""
        from specla.data.tokenizer import load_tokenizer

        model_dir = Path(model_dir) if model_dir is not None else DEMO_DIR
        if model_dir == DEMO_DIR and not (DEMO_DIR / "config.json").is_file():
            raise CheckpointError("no --model given and the demo model is not installed with this package")
        dev = resolve_device(device)
        model = load_model(model_dir, device=dev, dtype=resolve_dtype(dtype, dev))
        if compile is not None:
            from specla.fused import MODES, fuse

            if compile not in MODES:
                raise InputError(f"unknown compile mode {compile!r}; choose one of {', '.join(MODES)}")
            fuse(model, mode=compile)
        try:
            tokenizer = load_tokenizer(model_dir)
        except FileNotFoundError as e:
            raise CheckpointError(str(e)) from None
        return cls(model, tokenizer, model_dir)

    # prompts ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool | None = None) -> list[int]:
        """Text is wrapped in the chat template as one user turn (when the tokenizer has one and
        `chat` is not False); a list of {role, content} turns always is; token ids pass through."""
        if isinstance(prompt, str):
            if chat is None:
                chat = self.tokenizer.chat_template is not None
            if chat and prompt:
                return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        prompt = list(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt)
        return [int(t) for t in prompt]

    # drafters -------------------------------------------------------------------------------
    def drafter(self, route: str, chain_length: int = 8, tree_topk: int = 4, tree_budget: int = 16,
                tree_depth: int | tuple[int, int] = 8, tree_tau: float | None = None, drafter: str = "auto",
                tree_width: int | None = None, tree_temperature: float | None = None) -> Drafter | None:
        """The drafter serving a route: the checkpoint's trained EAGLE drafter (`<model>/drafter/`)
        when there is one and `drafter` is not "ngram", else prompt lookup. tree_width: the trained
        drafter's beams kept a depth (default tree_topk); tree_temperature: of its distribution in
        the tree scores (default `eagle.TREE_TEMPERATURE`); tree_depth (shallow, deep): the trained
        drafter's rollout depth chosen each round from the last round report read
        (`drafters.tree.DepthPolicy`)."""
        if route not in ROUTES:
            raise InputError(f"unknown route {route!r}; choose one of {', '.join(ROUTES)}")
        if drafter not in DRAFTERS:
            raise InputError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if chain_length < 1 or tree_topk < 1 or tree_budget < 1 or \
                min(tree_depth if isinstance(tree_depth, (tuple, list)) else (tree_depth,)) < 1:
            raise InputError("chain length, tree top-k, depth and budget must be positive")
        if route == "ar":
            return None
        if route in ("chain", "tree", "fla") and drafter != "ngram":
            from specla.drafters.eagle import TREE_TEMPERATURE, EagleDrafter, find_drafter, load_drafter

            path = find_drafter(self.model_dir)
            if path is not None:
                if self._eagle is None:
                    self._eagle = load_drafter(path, self.model, device=self.model.device, dtype=self.model.dtype)
                graphs = self.model.device.type == "cuda"
                if route in ("chain", "fla"):
                    return EagleDrafter(self._eagle, self.model, topk=1, depth=chain_length, graphs=graphs)
                return EagleDrafter(self._eagle, self.model, topk=tree_topk, depth=tree_depth, budget=tree_budget,
                                    tau=tree_tau, graphs=graphs, width=tree_width,
                                    temperature=TREE_TEMPERATURE if tree_temperature is None else tree_temperature)
            if drafter == "eagle":
                raise InputError(f"{self.model_dir} has no drafter/ directory (train one with `specla train drafter`)")
        if route in ("chain", "fla"):  # fla: the FLA-SD baseline verifies the same chains
            return NgramDrafter(length=chain_length, topk=1)
        if route == "tree":
            return NgramDrafter(length=max(1, tree_budget // tree_topk), topk=tree_topk, budget=tree_budget)
        if route in ("dspark", "ready"):  # parallel block drafters (docs/ready.md): <model>/dspark/, <model>/ready/
            from specla.drafters import dspark, ready
            from specla.drafters.blocks import block_drafter, find_block_drafter

            path = find_block_drafter(self.model_dir, route)
            if path is None:
                raise InputError(f"{self.model_dir} has no {route}/ directory (train one with "
                                 f"`specla train drafter --kind {route}`)")
            kind = dspark.MODEL_TYPE if route == "dspark" else ready.MODEL_TYPE
            return block_drafter(path, self.model, expect=kind, block=min(chain_length, 7),
                                 graphs=self.model.device.type == "cuda")
        from specla.drafters.mtp import MTPDrafter

        return MTPDrafter.from_checkpoint(self.model_dir, self.model, length=chain_length)

    def served_drafter(self, route: str, *options, **named) -> Drafter | None:
        """The drafter `generate` serves a route with (`drafter`'s options, its defaults filled
        in): made once per option set and kept, with the graphs it compiles and captures."""
        args = _DRAFTER_OPTIONS.bind(self, route, *options, **named)
        args.apply_defaults()
        if isinstance(args.arguments["tree_depth"], list):  # an adaptive depth from JSON: a hashable key
            args.arguments["tree_depth"] = tuple(args.arguments["tree_depth"])
        key = tuple(args.arguments.values())[1:]  # without self
        if key not in self._drafters:
            self._drafters[key] = self.drafter(*key)
        return self._drafters[key]

    # generation -----------------------------------------------------------------------------
    def generate(self, prompt, route: str = "chain", max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, chat: bool | None = None, chain_length: int = 8,
                 tree_topk: int = 4, tree_budget: int = 16, tree_depth: int | tuple[int, int] = 8,
                 tree_tau: float | None = None,
                 drafter: str = "auto", delayed: bool = True, on_text=None, pipeline: bool = True,
                 exact: bool = False, tree_width: int | None = None,
                 tree_temperature: float | None = None) -> Generation:
        """`exact`: every target call verifies the same number of nodes (`decode.EXACT_WIDTH`;
        AR steps too), so every route's output is bit-identical to exact-mode `ar` in any
        precision, at the cost of a slower AR step (docs/exact.md)."""
        ids = self.encode_prompt(prompt, chat)
        served = self.served_drafter(route, chain_length, tree_topk, tree_budget, tree_depth, tree_tau, drafter,
                                     tree_width, tree_temperature)
        decoder = Decoder(self.model, served, route, targets=self._targets,
                          sampling=Sampling(temperature, top_p, seed), delayed=delayed, pipeline=pipeline,
                          eos_token_ids=self.tokenizer.eos_token_ids | set(self.model.cfg.eos_token_id),
                          executor="fla" if route == "fla" else "specla",
                          exact_width=EXACT_WIDTH if exact else None)
        stream = TextStream(self.tokenizer)
        res: GenerationResult = decoder.generate(
            ids, max_new_tokens, on_tokens=(lambda t: on_text(stream.push(t))) if on_text else None)
        return Generation(
            text=self.tokenizer.decode(res.tokens), tokens=res.tokens, route=route, rounds=len(res.rounds),
            mean_accepted_length=res.mean_accepted_length, first_token_match=res.first_token_match,
            tokens_per_second=res.tokens_per_second, prefill_seconds=res.prefill_seconds,
            decode_seconds=res.decode_seconds, stop_reason=res.stop_reason, prompt_tokens=len(ids))

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Yield text pieces as rounds accept them; the Generation is the iterator's return value."""
        q: queue.Queue = queue.Queue()
        done = object()
        box: dict = {}

        def work():
            try:
                box["result"] = self.generate(prompt, on_text=q.put, **kwargs)
            except BaseException as e:  # re-raised in the caller's thread
                box["error"] = e
            q.put(done)

        threading.Thread(target=work, daemon=True).start()
        while (piece := q.get()) is not done:
            if piece:
                yield piece
        if "error" in box:
            raise box["error"]
        return box["result"]

    def verify(self, prompt, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Target logits [n, vocab] for a topology whose root is the prompt's last token.

        `tokens[0]` must be that root; `parents` is the topological parent array.
        """
        ids = self.encode_prompt(prompt, chat=False)
        par = as_parents(parents)
        if len(tokens) != par.shape[1]:
            raise InputError(f"{len(tokens)} tokens but {par.shape[1]} parents")
        if not ids or tokens[0] != ids[-1]:
            raise InputError("tokens[0] must be the root: the prompt's last token")
        bad = [t for t in tokens if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is out of range for vocabulary size {self.model.cfg.vocab_size}")
        cache = self.model.new_cache()
        if len(ids) > 1:
            self.model(torch.tensor([ids[:-1]], device=self.model.device), cache)
        t = torch.tensor([list(tokens)], device=self.model.device)
        return self.model.verify(t, par.to(self.model.device), cache).logits[0]


# bound once: `inspect.signature` of a method costs ~35 us, paid by every generation
_DRAFTER_OPTIONS = inspect.signature(SpecLA.drafter)


def load(model_dir: str | Path | None = None, device: str = "auto", dtype: str = "auto",
         compile: str | None = None) -> SpecLA:
    return SpecLA.load(model_dir, device, dtype, compile)
