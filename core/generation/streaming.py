"""A continuation's text as its tokens come (generate.stream), for printing: pieces that, joined, are the text of all
the tokens decoded at once (what the output file records).

A token's text alone is not always a piece of that text: a byte-level token may hold part of a UTF-8 character
(decoded alone: U+FFFD), and some decoders change a token's text by what comes before it (a SentencePiece word's
leading space is dropped at the start of a text). So each time the tokens so far are decoded together, and what is
new after the text already out comes out, except a run of U+FFFD at the end (a character still incomplete), held
back until the next tokens complete it, or the end (where a U+FFFD the model really wrote comes out too). Decoding
the whole continuation for every token costs little beside the model's forward pass for it.

One case cannot be streamed exactly: a decoder that rewrites text already out. SentencePiece's byte fallback does,
for a model that writes byte tokens that are no UTF-8 (each byte of such a run, an ASCII one too, becomes U+FFFD
once an invalid one follows). The stream then goes on from where the new text parts from what is out: the rewritten
part comes out again after it (the screen shows the byte's character, then the U+FFFD that replaced it), and every
later token's text follows as usual; the output file has the decoder's text alone.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole UTF-8 character


class TextStream:
    """push(token) each new token, then end(): the pieces of decode(tokens) in order (after a rewrite, those of the
    rewritten text from where it differs: module docstring)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.out = ""  # the text given out so far

    def push(self, token: int) -> str:
        """The text that `token` completes (often its own, possibly "" or more than its own)."""
        self.tokens.append(int(token))
        return self._piece(self.decode(self.tokens).rstrip(REPLACEMENT))

    def end(self) -> str:
        """The text still held back (an incomplete character at the very end comes out as U+FFFD)."""
        return self._piece(self.decode(self.tokens))

    def _piece(self, text: str) -> str:
        if text.startswith(self.out):
            start = len(self.out)
        elif self.out.startswith(text):  # shorter: a character held back, nothing new yet
            return ""
        else:  # a decoder that rewrote text already out: on from where the two part, never silent from here
            start = len(os.path.commonprefix([self.out, text]))
        piece = text[start:]
        if piece:
            self.out = text
        return piece
