"""Tokenizer: sentencepiece (`tokenizer.model`, Llama 1/2, TinyLlama and the bundled demo) or a
byte-level `tokenizer.json` (Llama 3, read with the `tokenizers` package when it is installed).

Adds BOS/EOS, the Llama-2 chat template, and incremental detokenization for streaming.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .errors import CheckpointError, MinferError

BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tokenizer.model"
_INCOMPLETE = "\ufffd"  # what a decoder emits for the bytes of a character that has not fully arrived


def require_utf8(text: str, what: str = "the text to encode") -> None:
    """Refuse text holding bytes that are not UTF-8: Python passes them on from argv (and from files
    read with surrogateescape) as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        found = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise MinferError(f"{what} is not valid UTF-8 text ({found} at character {exc.start}); "
                          "pass UTF-8 text") from None


def bundled_tokenizer_path() -> Path:
    """The sentencepiece model trained on minfer/data/corpus by `python -m minfer.demo --tokenizer`."""
    return BUNDLED_TOKENIZER


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"tokenizer file {path} {'is a folder' if path.is_dir() else 'does not exist'}")
        self.path = path
        self._backend = _HFJson(path) if path.suffix == ".json" else _SentencePiece(path)
        self.bos_id, self.eos_id = self._backend.bos_id, self._backend.eos_id
        self.vocab_size = self._backend.vocab_size

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        require_utf8(text)
        ids = self._backend.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Ids outside the vocabulary (a random-weight model larger than the bundled tokenizer)
        decode as the unknown token rather than failing."""
        return self._backend.decode([int(i) if 0 <= int(i) < self.vocab_size else self._backend.unk_id for i in ids])

    def chat_prompt(self, user_msg: str, system: str | None = None) -> list[int]:
        """Token ids of one Llama-2 chat turn: <s>[INST] <<SYS>>...<</SYS>> user [/INST]."""
        if system:
            user_msg = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user_msg}"
        return self.encode(f"[INST] {user_msg.strip()} [/INST]", bos=True)


class IncrementalDecoder:
    """Turns a stream of token ids into printable text deltas.

    Decodes a short window of recent tokens twice (with and without the newest ones) and emits the
    difference, so a piece's leading space survives (sentencepiece drops it only at the start of a
    window, which both decodes share) and a multi-byte character split over byte-fallback tokens is
    held back until its last byte arrives.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        # A few prompt tokens as context, so the first generated piece keeps its leading space;
        # the window must not start inside a multi-byte character.
        context = list(context_ids)[-6:]
        while context and tokenizer.decode(context).startswith(_INCOMPLETE):
            context.pop(0)
        self._ids = context
        self._prefix = 0  # window start
        self._read = len(context)  # tokens before this index have been emitted

    def feed(self, ids: int | Iterable[int]) -> str:
        self._ids.extend([ids] if isinstance(ids, int) else ids)
        emitted = self.tokenizer.decode(self._ids[self._prefix:self._read])
        current = self.tokenizer.decode(self._ids[self._prefix:])
        if current.endswith(_INCOMPLETE) or len(current) <= len(emitted):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return current[len(emitted):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        emitted = self.tokenizer.decode(self._ids[self._prefix:self._read])
        current = self.tokenizer.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return current[len(emitted):]


class _SentencePiece:
    def __init__(self, path: Path):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{path} is not a sentencepiece model ({e})") from None
        self.bos_id, self.eos_id, self.unk_id = self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id()
        self.vocab_size = self._sp.vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


class _HFJson:
    """A tokenizer.json (byte-level BPE); BOS/EOS come from the tokenizer_config.json beside it."""

    def __init__(self, path: Path):
        try:
            import tokenizers
        except ImportError:
            raise MinferError(f"{path} needs the 'tokenizers' package: pip install tokenizers") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise MinferError(f"{path} is not a readable tokenizer.json ({e})") from None
        special = _special_tokens(path.with_name("tokenizer_config.json"))
        self.bos_id, self.eos_id = (self._token_id(special.get(k), k) for k in ("bos_token", "eos_token"))
        unk_id = self._tok.token_to_id(special.get("unk_token") or "")
        self.unk_id = self.eos_id if unk_id is None else unk_id  # id 0 is a valid unk id
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _token_id(self, token: str | None, role: str) -> int:
        token_id = self._tok.token_to_id(token) if token else None
        if token_id is None:
            raise CheckpointError(f"tokenizer_config.json names no usable {role} (got {token!r})")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _special_tokens(config_path: Path) -> dict[str, str]:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{config_path} is missing; it names the BOS/EOS tokens of tokenizer.json") from None
    tokens = {}
    for key in ("bos_token", "eos_token", "unk_token"):
        value = config.get(key)
        tokens[key] = value.get("content") if isinstance(value, dict) else value
    return tokens


def read_text_file(path: str | Path, what: str) -> str:
    """The text of a user's UTF-8 file; a missing, unreadable or non-UTF-8 file is a MinferError
    that starts with `what` (e.g. "calibration text")."""
    path = Path(path)
    if not path.is_file():
        problem = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise MinferError(f"{what} {path} {problem}; pass a UTF-8 text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MinferError(f"{what} {path} is not UTF-8 text (byte {exc.start}: "
                          f"{exc.object[exc.start:exc.start + 1]!r}); pass a UTF-8 text file") from None
    except OSError as exc:
        raise MinferError(f"{what} {path} cannot be read ({exc.strerror})") from None
