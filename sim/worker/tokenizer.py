"""A whitespace tokenizer, the chat template and the deterministic text the engine generates.

One token per whitespace-separated word: `text.split()` decides the words, and a word's id is
the CRC-32 of its UTF-8 bytes masked to 31 bits, so ids agree across processes and machines
(Python's salted `hash` of a str would not). Generated text is words joined by single spaces,
so a client that sends an answer back in the next turn produces exactly the generated ids.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ID_MASK = 0x7FFFFFFF
ASSISTANT_TAG = "<|assistant|>"


_ID_OF: dict[str, int] = {}  # word -> id of every word seen so far (bounded below)
_ID_OF_MAX = 1 << 20


def token_id(word: str) -> int:
    known = _ID_OF.get(word)
    if known is None:
        if len(_ID_OF) > _ID_OF_MAX:
            _ID_OF.clear()
        known = _ID_OF[word] = zlib.crc32(word.encode("utf-8")) & ID_MASK
    return known


def tokenize(text: str) -> list[int]:
    # A C-level dict pass over the words: a long prompt's admission must not stall every
    # stream on the worker's event loop; only words not seen before are hashed.
    words = text.split()
    ids: list[int | None] = list(map(_ID_OF.get, words))
    if None not in ids:
        return ids  # type: ignore[return-value]  # every word was known
    return [token_id(w) if i is None else i for i, w in zip(ids, words, strict=True)]


def count_tokens(text: str) -> int:
    return len(text.split())


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(text)
        return " ".join(texts)
    raise ValueError("message content must be a string or a list of text parts")


class _PieceCache:
    """Token ids of recently seen long texts, at most `max_tokens` of them in all.

    A chat turn resends the whole conversation: without this, every turn re-tokenises every
    earlier message, and a long context's admission stalls all streams on the worker's event
    loop for milliseconds. The lists share the word cache's int objects, so a cached token
    costs one pointer.
    """

    def __init__(self, max_tokens: int) -> None:
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._max = max_tokens
        self._size = 0

    def ids(self, text: str) -> list[int]:
        found = self._ids.get(text)
        if found is not None:
            self._ids.move_to_end(text)
            return found
        found = tokenize(text)
        if len(found) <= self._max:
            self._ids[text] = found
            self._size += len(found)
            while self._size > self._max:
                self._size -= len(self._ids.popitem(last=False)[1])
        return found


_PIECES = _PieceCache(max_tokens=1 << 22)
_CACHED_FROM_CHARS = 256  # shorter texts tokenise faster than a cache round trip


def chat_token_ids(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """`tokenize(render_chat(messages))`, message by message, long messages from a cache.

    Equal because the rendering joins pieces with spaces and no piece's words span two
    pieces (roles hold no whitespace): splitting the whole is splitting each piece.
    """
    ids: list[int] = []
    for role, text in _chat_pieces(messages):
        ids.append(token_id(f"<|{role}|>"))
        if text:
            ids += _PIECES.ids(text) if len(text) >= _CACHED_FROM_CHARS else tokenize(text)
    ids.append(token_id(ASSISTANT_TAG))
    return ids


def _chat_pieces(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    if not messages:
        raise ValueError("messages must not be empty")
    pieces: list[tuple[str, str]] = []
    for message in messages:
        role = message.get("role")
        if not isinstance(role, str) or not role or any(c.isspace() for c in role):
            raise ValueError("each message needs a 'role' string without whitespace")
        text = _content_text(message.get("content"))
        pieces.append((role, "" if not text or text.isspace() else text))
    return pieces


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """Render OpenAI chat messages as "<|role|> content ..." and a final "<|assistant|>".

    Each message costs one tag token plus its content's words, and the generation prompt one
    more, so a turn's rendering equals the previous turn's rendering, plus the assistant
    answer, plus the new messages: prefix caching hits across turns.
    """
    pieces: list[str] = []
    for role, text in _chat_pieces(messages):
        pieces.append(f"<|{role}|>")
        if text:
            pieces.append(text)
    pieces.append(ASSISTANT_TAG)
    return " ".join(pieces)


# Plain lowercase English words: the vocabulary of generated text.
VOCABULARY: tuple[str, ...] = tuple(
    """
    the of and to in is that it was for on are as with his they at be this from have or by
    one had not but what all were when we there can an your which their said if do will each
    about how up out them then she many some so these would other into has more her two like
    him see time could no make than first been its who now people my made over did down only
    way find use may water long little very after words called just where most know get
    through back much before go good new write our used me man too any day same right look
    think also around another came come work three word must because does part even place well
    such here take why things help put years different away again off went old number great
    tell men say small every found still between name should home big give air line set own
    under read last never us left end along while might next sound below saw something thought
    both few those always looked show large often together asked house world going want school
    important until form food keep children feet land side without boy once animals life enough
    took sometimes four head above kind began almost live page got earth need far hand high
    year mother light parts country father let night following picture being study second eyes
    soon times story boys since white days ever paper hard near sentence better best across
    during today others however sure means knew try told young miles sun ways thing whole hear
    example heard several change answer room sea against top turned learn point city play toward
    five using himself usually money seen car morning given became body family later order
    river stone garden window table music green field bridge cloud winter summer forest valley
    market letter street village engine signal harbor quiet bright simple careful gentle
    """.split()
)
_VOCAB_IDS: tuple[int, ...] = tuple(token_id(w) for w in VOCABULARY)
_VOCAB_INDEX: dict[str, int] = {w: i for i, w in enumerate(VOCABULARY)}

_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15
_VOCAB_SIZE = len(VOCABULARY)


def _mix(x: int) -> int:
    # splitmix64 finaliser: a cheap, well-spread integer hash.
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class WordGenerator:
    """Deterministic generated words: word i of a request depends on (seed, request_id, i)."""

    __slots__ = ("seed",)

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def request_key(self, request_id: str) -> int:
        """A 64-bit key for `request_id`; `index_at(key, i)` then costs no string hashing."""
        data = f"{self.seed}\x00{request_id}".encode()
        return (zlib.crc32(data) << 32) | zlib.adler32(data)

    @staticmethod
    def index_at(key: int, index: int) -> int:
        """Vocabulary index of word `index` for a request key."""
        return _mix((key + (index + 1) * _GOLDEN) & _M64) % _VOCAB_SIZE

    @staticmethod
    def token_id_at(key: int, index: int) -> int:
        """Token id of word `index` (the engine's per-token hot path: `_mix` inlined)."""
        x = (key + (index + 1) * _GOLDEN) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return _VOCAB_IDS[(x ^ (x >> 31)) % _VOCAB_SIZE]

    @staticmethod
    def token_ids_at(key: int, start: int, count: int) -> list[int]:
        """`token_id_at(key, i)` for i in [start, start + count), in one pass."""
        ids = _VOCAB_IDS
        out: list[int] = []
        append = out.append
        x = (key + (start + 1) * _GOLDEN) & _M64
        for _ in range(count):
            y = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
            y = ((y ^ (y >> 27)) * 0x94D049BB133111EB) & _M64
            append(ids[(y ^ (y >> 31)) % _VOCAB_SIZE])
            x = (x + _GOLDEN) & _M64
        return out

    def words(self, request_id: str, start: int, count: int) -> list[str]:
        key = self.request_key(request_id)
        return [VOCABULARY[self.index_at(key, i)] for i in range(start, start + count)]

    @staticmethod
    def token_ids_for(words: Iterable[str]) -> list[int]:
        return [_VOCAB_IDS[_VOCAB_INDEX[w]] if w in _VOCAB_INDEX else token_id(w) for w in words]
