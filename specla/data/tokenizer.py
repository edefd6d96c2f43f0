"""Demo tokenizer: training it on the corpus, and a small loader for any HF tokenizer dir.

The chat format it is trained and saved with is `specla.data.chat`. The tokenizer is a
byte-level BPE (HF ``tokenizers``) with no normaliser and no post-processor, so
``decode(encode(s)) == s`` for every string ``s``.
"""

from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from specla.data.corpus import iter_documents, read_manifest
from specla.data.chat import BOS, CHAT_TEMPLATE, EOS, PAD, ROLE_TOKENS, SPECIAL_TOKENS, strip_special_tokens
from specla.errors import MissingDataError

__all__ = [
    "MODEL_MAX_LENGTH",
    "train_tokenizer",
    "save_tokenizer_files",
    "load_tokenizer",
    "TokenizerWrapper",
]

MODEL_MAX_LENGTH = 4096

# --------------------------------------------------------------------------- training


def _iter_training_text(corpus_dir: Path, max_chars: int | None, seed: int) -> Iterator[str]:
    """The training split (or a seeded random sample of about ``max_chars`` characters
    of its documents, every source in proportion), special tokens removed."""
    manifest = read_manifest(corpus_dir)
    total = int(manifest["splits"]["train"]["chars"]) or 1
    keep = 1.0 if max_chars is None else min(1.0, max_chars / total)
    rng = random.Random(seed)
    for doc in iter_documents(corpus_dir, "train"):
        if keep < 1.0 and rng.random() >= keep:
            continue
        for piece in strip_special_tokens(doc):
            # long documents are fed in slices: the BPE trainer counts words per
            # input, and smaller inputs parallelise better
            for start in range(0, len(piece), 1 << 16):
                yield piece[start:start + (1 << 16)]


def _build_bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.normalizer = None
    # digits are split one by one (arithmetic-friendly), then GPT-2 byte-level split
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    return tok, trainer


def save_tokenizer_files(tok, out_dir: str | os.PathLike, model_max_length: int = MODEL_MAX_LENGTH) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ROLE_TOKENS.values()),
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_TOKENS.values()),
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out


def train_tokenizer(
    corpus_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    vocab_size: int = 8192,
    *,
    max_chars: int | None = None,
    seed: int = 0,
) -> Path:
    """Train the demo byte-level BPE on the corpus training split (all of it by
    default, about 40 s for 122M characters on 2 cores; ``max_chars`` samples less).

    ``vocab_size`` counts everything: the 6 special tokens, the 256 byte symbols and
    the merges. Writes the HF tokenizer files to ``out_dir`` and returns it.
    """
    from tokenizers import Tokenizer

    corpus_dir = Path(corpus_dir)
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must exceed {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok, trainer = _build_bpe(vocab_size)
    tok.train_from_iterator(_iter_training_text(corpus_dir, max_chars, seed), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    # make sure specials are registered as special added tokens (split out of any text)
    tok = Tokenizer.from_str(tok.to_str())
    return save_tokenizer_files(tok, out_dir)


# --------------------------------------------------------------------------- loading


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and "content" in value:
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled once (compiling costs ~3 ms, more than the whole render)."""
    return _jinja_env().from_string(source)


def _jinja_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime

        return datetime.now().strftime(fmt)

    class _Generation(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} (assistant masks): render the body only
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclass
class TokenizerWrapper:
    """Minimal tokenizer interface used by specla (encode/decode/chat prompts/EOS ids)."""

    tokenizer: Any  # tokenizers.Tokenizer
    model_dir: Path
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)
    eos_token_ids: set[int] = field(default_factory=set)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    model_max_length: int | None = None
    add_bos_token: bool = False

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in ``text`` map to their ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def render_chat(self, turns: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for ``turns``; without a chat template, the turn contents
        joined by blank lines (a plain-text prompt)."""
        if self.chat_template is None:
            return "\n\n".join(t["content"] for t in turns)
        template = _compiled_template(self.chat_template)
        values = {k: v for k, v in self.special_tokens.items()}
        values.update(kwargs)
        return template.render(messages=[dict(t) for t in turns], add_generation_prompt=add_generation_prompt, **values)

    def apply_chat_template(self, turns: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the chat prompt (like transformers' ``apply_chat_template``).

        With a template the rendered text is encoded without extra special tokens (the
        template places them); without one the contents are encoded as plain text with
        the tokenizer's own special-token post-processing (e.g. a leading BOS).
        """
        text = self.render_chat(turns, add_generation_prompt=add_generation_prompt, **kwargs)
        if self.chat_template is None:
            ids = self.encode(text, add_special_tokens=True)
            if self.bos_token_id is not None and self.add_bos_token and ids[:1] != [self.bos_token_id]:
                ids = [self.bos_token_id] + ids
            return ids
        return self.encode(text, add_special_tokens=False)


def _chat_template_from(model_dir: Path, cfg: Mapping[str, Any]) -> str | None:
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in tmpl if isinstance(d, Mapping)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    if tmpl:
        return tmpl
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        data = _read_json(json_file)
        if isinstance(data.get("chat_template"), str):
            return data["chat_template"]
    return None


def load_tokenizer(model_dir: str | os.PathLike) -> TokenizerWrapper:
    """Load the tokenizer of an HF model directory (``tokenizer.json`` required).

    Works for the specla demo model and for real checkpoints (fla GatedDeltaNet, HF
    Qwen3-Next): EOS ids are the union of ``tokenizer_config.json``'s ``eos_token``
    and the ``eos_token_id`` of ``generation_config.json`` / ``config.json`` (int or
    list). Without a chat template, prompts are plain text.
    """
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise MissingDataError(f"no tokenizer.json in {model_dir} (expected an HF model/tokenizer directory)")
    tok = Tokenizer.from_file(str(tok_file))
    cfg = _read_json(model_dir / "tokenizer_config.json")
    gen = _read_json(model_dir / "generation_config.json")
    model_cfg = _read_json(model_dir / "config.json")

    special: dict[str, Any] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        special[key] = _token_content(cfg.get(key))

    def tid(token: str | None) -> int | None:
        return None if token is None else tok.token_to_id(token)

    eos: set[int] = set()
    if tid(special["eos_token"]) is not None:
        eos.add(tid(special["eos_token"]))
    for src in (gen, model_cfg):
        eos.update(_ids(src.get("eos_token_id")))
    bos = tid(special["bos_token"])
    if bos is None:
        bos_ids = _ids(gen.get("bos_token_id")) or _ids(model_cfg.get("bos_token_id"))
        bos = bos_ids[0] if bos_ids else None
    pad = tid(special["pad_token"])
    if pad is None:
        pad_ids = _ids(gen.get("pad_token_id")) or _ids(model_cfg.get("pad_token_id"))
        pad = pad_ids[0] if pad_ids else None
    max_len = cfg.get("model_max_length")
    if not isinstance(max_len, int) or max_len > 10**9:
        max_len = None
    return TokenizerWrapper(
        tokenizer=tok,
        model_dir=model_dir,
        chat_template=_chat_template_from(model_dir, cfg),
        special_tokens=special,
        eos_token_ids=eos,
        bos_token_id=bos,
        pad_token_id=pad,
        model_max_length=max_len,
        add_bos_token=bool(cfg.get("add_bos_token", False)),
    )
