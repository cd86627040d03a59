"""generate.stream's pieces (core/generation/streaming.py): joined, the text of all the tokens decoded at once, for
a byte tokenizer and byte-level and SentencePiece-style BPEs, with characters of 2 to 4 bytes split across tokens;
and no piece ends in half a character."""

from __future__ import annotations

import random

import pytest

from core.generation.streaming import REPLACEMENT, TextStream
from recipes.gpt.tokenizer import ByteTokenizer

TEXTS = ["héllo wörld, the cat sat", "猫が座った the mat", "emoji 🐈‍⬛ and 🐟 fish", "naïve café ñandú"]


def _bpe(kind: str):
    """A tiny BPE trained here: byte-level (GPT-2, Llama 3) or Metaspace (SentencePiece: a word's leading space is
    dropped at the start of a decoded text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=290, initial_alphabet=alphabet, special_tokens=[*alphabet][:0])
    tok.train_from_iterator(TEXTS * 3, trainer)
    if kind != "byte_level":
        tok.add_tokens([a for a in alphabet if tok.token_to_id(a) is None])
    return tok


def _pieces(decode, ids) -> list[str]:
    stream = TextStream(decode)
    return [stream.push(i) for i in ids] + [stream.end()]


@pytest.mark.parametrize("kind", ["byte", "byte_level", "metaspace"])
def test_the_pieces_join_to_the_whole_decode_and_never_end_in_half_a_character(kind):
    if kind == "byte":
        tok = ByteTokenizer()
        encode, decode, vocab = tok.encode, tok.decode, 256
    else:
        bpe = _bpe(kind)
        encode = lambda text: bpe.encode(text, add_special_tokens=False).ids  # noqa: E731
        decode = lambda ids: bpe.decode(list(ids), skip_special_tokens=False)  # noqa: E731
        vocab = bpe.get_vocab_size()
    split = 0
    for text in TEXTS:
        ids = encode(text)
        assert decode(ids) == text
        pieces = _pieces(decode, ids)
        assert "".join(pieces) == text
        assert not any(p.endswith(REPLACEMENT) for p in pieces)
        split += sum(REPLACEMENT in decode([i]) for i in ids)  # tokens holding part of a character
    assert kind == "metaspace" or split > 0  # (the byte-level vocabularies do split characters)
    # What a model writes: any ids, half characters and invalid bytes among them (for the byte-fallback vocabulary,
    # whose decoder makes every byte of a run that is not UTF-8 a U+FFFD, ids of text: its docstring says why).
    rng = random.Random(0)
    for _ in range(50):
        if kind == "metaspace":
            ids = encode(
                "".join(
                    chr(rng.choice([rng.randrange(32, 0x3000), rng.randrange(0x1F300, 0x1F600)])) for _ in range(20)
                )
            )
        else:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        assert "".join(_pieces(decode, ids)) == decode(ids), ids


def test_a_piece_comes_as_soon_as_its_character_is_whole():
    decode = ByteTokenizer().decode
    stream = TextStream(decode)
    cat = "🐈".encode()  # 4 bytes
    assert [stream.push(b) for b in b"a"] == ["a"]
    assert [stream.push(b) for b in cat] == ["", "", "", "🐈"]
    assert stream.push(cat[0]) == "" and stream.end() == REPLACEMENT  # cut off: what decode gives too


def test_after_a_decoder_rewrites_what_is_out_the_stream_goes_on():
    """SentencePiece's byte fallback makes 'A' (an ASCII byte token) U+FFFD once an invalid byte follows it: the
    stream then prints the rewritten text from where it parts from what is out, and every later token's text."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<0x41>": 1, "<0xFF>": 2, "b": 3, "c": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    ids = [1, 2, 3, 4, 3, 4]
    assert decode(ids[:1]) == "A" and decode(ids) == REPLACEMENT * 2 + "bcbc"  # the 'A' rewritten
    assert _pieces(decode, ids) == ["A", "", REPLACEMENT * 2 + "b", "c", "b", "c", ""]
