"""The demo chat format: its special tokens and how turns are rendered.

The single source of truth is :func:`render_chat`; :data:`CHAT_TEMPLATE` is its Jinja mirror,
stored in ``tokenizer_config.json`` (`specla.data.tokenizer`)::

    <|bos|>
    <|system|>\\n{content}\\n            (system and user turns end with "\\n")
    <|user|>\\n{content}\\n
    <|assistant|>\\n{content}<|eos|>    (assistant turns end with <|eos|>)
    ...
    <|assistant|>\\n                    (generation prompt, if requested)

``<|eos|>`` ends both a document and an assistant turn, so generation stops on it and
``render(turns[:k], add_generation_prompt=True) + reply + "<|eos|>"`` is always a prefix
of ``render(turns)``: multi-turn prompts never re-tokenise earlier turns differently.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
ROLES: tuple[str, ...] = ("system", "user", "assistant")
ROLE_TOKENS: dict[str, str] = {r: f"<|{r}|>" for r in ROLES}
#: All special tokens, in id order (ids 0..5 in the demo tokenizer).
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, *ROLE_TOKENS.values())

# Jinja mirror of render_chat (transformers renders with trim_blocks/lstrip_blocks;
# the template is a single line so those settings do not matter).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + '\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% endif %}"
)

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def render_chat(turns: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """Render ``turns`` (dicts with ``role`` in system/user/assistant and ``content``).

    This is the reference semantics of the demo chat template; the Jinja template
    :data:`CHAT_TEMPLATE` produces exactly the same text.
    """
    parts = [BOS]
    for i, turn in enumerate(turns):
        role = turn["role"]
        content = turn["content"]
        if role not in ROLE_TOKENS:
            raise ValueError(f"unknown chat role {role!r} in turn {i}; valid roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise TypeError(f"turn {i}: content must be a string, got {type(content).__name__}")
        parts.append(ROLE_TOKENS[role])
        parts.append("\n")
        parts.append(content)
        parts.append(EOS if role == "assistant" else "\n")
    if add_generation_prompt:
        parts.append(ROLE_TOKENS["assistant"] + "\n")
    return "".join(parts)


def strip_special_tokens(text: str) -> list[str]:
    """Split ``text`` on the demo special tokens and return the non-empty pieces."""
    return [p for p in _SPECIAL_RE.split(text) if p]
