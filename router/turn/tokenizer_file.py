"""Exact prompt token counts from a local tokenizer file (`--tokenizer tokenizer.json`).

Optional: needs the `tokenizers` package (`pip install 'session-router[tokenizer]'`). Without a
file the router estimates counts from text length, calibrated from the usage workers report.
Chat prompts are counted as their messages' content; the chat template's few tokens per
message (`TEMPLATE_TOKENS_PER_MESSAGE`) are the one estimated part.
"""

from __future__ import annotations

from typing import Any

from router.turn.fields import RoutingFields, content_text, prompt_text, text_size

TEMPLATE_TOKENS_PER_MESSAGE = 4


class LocalTokenizer:
    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ValueError(
                "--tokenizer needs the 'tokenizers' package: "
                "pip install 'session-router[tokenizer]'"
            ) from exc
        try:
            self._tokenizer: Any = Tokenizer.from_file(path)
        except Exception as exc:  # the library raises its own exception types
            raise ValueError(f"cannot load tokenizer file {path!r}: {exc}") from exc

    def _count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, fields: RoutingFields) -> int:
        if fields.messages is not None:
            return sum(
                self._count(content_text(message.content)) + TEMPLATE_TOKENS_PER_MESSAGE
                for message in fields.messages
            )
        _, token_ids = text_size(fields)  # a prompt of token ids counts itself
        if token_ids is not None:
            return token_ids
        return self._count(prompt_text(fields.prompt))
