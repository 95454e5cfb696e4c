"""The task's tokenizer: every integer 0..max_number is one token, plus the few symbols of the arithmetic task.

Pure python, nothing downloaded. With the default ``max_number=255`` the vocabulary has 266 tokens, far above
the top-K width K=20, so the tail outside the top-20 of a rollout distribution is a real (if small) mass.
``decode`` writes the text the reward parses (``49 , 44 \\boxed{44}``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
SYMBOLS: tuple[str, ...] = ("+", "-", "=", ",", "\\boxed{", "}", "_")
#: what one token is, as ``re.findall`` splits text (whitespace between tokens is dropped)
PIECE_PATTERN = r"<pad>|<bos>|<eos>|\\boxed\{|\d+|[+\-=,}_]|\S"
_PIECE = re.compile(PIECE_PATTERN)
#: ``decode`` joins tokens with spaces, then makes these replacements in order (``\\boxed{ 4 }`` -> ``\\boxed{4}``)
DECODE_JOINS: tuple[tuple[str, str], ...] = (("\\boxed{ ", "\\boxed{"), (" }", "}"))


class ArithmeticTokenizer:
    """Whole-number tokenizer for ``predmask.rl.task``."""

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, max_number: int = 255) -> None:
        if max_number < 20:
            raise ValueError(f"max_number must be >= 20, got {max_number}")
        self.max_number = max_number
        self.tokens: tuple[str, ...] = SPECIALS + SYMBOLS + tuple(str(n) for n in range(max_number + 1))
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self.number_offset = len(SPECIALS) + len(SYMBOLS)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_id(self, token: str) -> int:
        try:
            return self._ids[token]
        except KeyError:
            raise ValueError(
                f"token {token!r} is not in the vocabulary (numbers 0..{self.max_number} and {SYMBOLS + SPECIALS})"
            ) from None

    def number_id(self, n: int) -> int:
        if not 0 <= n <= self.max_number:
            raise ValueError(f"number {n} is outside the vocabulary range 0..{self.max_number}")
        return self.number_offset + n

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Split ``text`` into tokens; numbers above ``max_number`` or unknown characters raise ValueError."""
        ids = [self.token_id(p) for p in _PIECE.findall(text)]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True, stop_at_eos: bool = True) -> str:
        """Text of ``ids``; stops at the first ``<eos>`` unless ``stop_at_eos`` is False."""
        out: list[str] = []
        for i in ids:
            i = int(i)
            if stop_at_eos and i == self.eos_id:
                break
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} outside the vocabulary [0, {len(self.tokens)})")
            if skip_special and i < len(SPECIALS):
                continue
            out.append(self.tokens[i])
        text = " ".join(out)
        for spaced, joined in DECODE_JOINS:
            text = text.replace(spaced, joined)
        return text
