"""IncrementalDetokenizer on the tiny tokenizer (and a byte-level BPE one): the streamed text is exactly
``decode(all_ids)``, and text is held back only while the decoder could still change it.

Why the tiny random-weight model's streams look like noise: it samples ids about uniformly over the
vocab, and half of the vocab is ``<unusedN>`` specials (no text with skip_special_tokens) and a quarter is
byte-fallback tokens (control characters, or U+FFFD for invalid UTF-8, exactly as ``decode`` gives)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import tokenizers

from g4serve.processing.tiny_tokenizer import SPECIAL_TOKENS, TOOL_TOKENS, write_tiny_tokenizer
from g4serve.processing.tokenizer import IncrementalDetokenizer, Tokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def tok_fffd(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny tokenizer plus ordinary (non-special) tokens that spell U+FFFD themselves."""
    dst = tmp_path_factory.mktemp("tiny_fffd") / "tok"
    shutil.copytree(tiny_dir, dst)
    backend = tokenizers.Tokenizer.from_file(str(dst / "tokenizer.json"))
    new = [tokenizers.AddedToken(t, special=False, normalized=False) for t in (FFFD, "x" + FFFD)]
    backend.add_tokens(new)
    backend.save(str(dst / "tokenizer.json"))
    return Tokenizer.from_pretrained(dst)


@pytest.fixture(scope="module")
def tok_byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A byte-level BPE (GPT-2 style): no <0xNN> tokens, a character's bytes spread over ordinary tokens."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(["hello world, the bank account"], trainer)
    d = tmp_path_factory.mktemp("byte_level")
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return Tokenizer.from_pretrained(d)


def _byte(tok: Tokenizer, *values: int) -> list[int]:
    return [tok.token_to_id(f"<0x{v:02X}>") for v in values]


def _check_stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    """Stream ``ids``; check exactness and that text is held no longer than the decoder requires."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, released_upto = [], 0
    for k, i in enumerate(ids):
        pieces.append(detok.add(i))
        kept = not (skip and i in tok.special_token_ids) and tok.id_to_token(i) is not None
        if kept and i not in tok.byte_token_ids and tok.byte_token_ids:
            released_upto = k + 1  # a kept non-byte token ends any byte run: nothing before it can change
        # Byte-fallback tokenizers: all text up to the last kept non-byte token is out, and nothing later.
        if tok.byte_token_ids:
            expected = tok.decode(ids[:released_upto], skip_special_tokens=skip)
            assert detok.text == expected, (ids[: k + 1], skip)
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces) and detok.token_ids == ids
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    return pieces


def _kinds(tok: Tokenizer) -> dict[str, list[int]]:
    unused = [i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "").startswith("<unused")]
    named = list(range(len(SPECIAL_TOKENS))) + [tok.token_to_id(t) for t in TOOL_TOKENS]
    normal = [
        i for i in range(tok.vocab_size) if i not in tok.special_token_ids and i not in tok.byte_token_ids
    ]
    return {"bytes": sorted(tok.byte_token_ids), "unused": unused, "named": named, "normal": normal}


def test_tiny_vocab_composition(tok: Tokenizer) -> None:
    """The numbers behind "the tiny model's replies look like noise"."""
    kinds = _kinds(tok)
    assert tok.vocab_size == 1024
    assert {k: len(v) for k, v in kinds.items()} == {"bytes": 256, "unused": 502, "named": 24, "normal": 242}
    assert len(tok.special_token_ids) == 24 + 502
    assert all(tok.decode([i], skip_special_tokens=True) == "" for i in kinds["unused"] + kinds["named"])
    # Byte tokens 0x00-0x1F are control characters; a lone byte >= 0x80 is invalid UTF-8: U+FFFD.
    assert [tok.decode(_byte(tok, b)) for b in (0x00, 0x1A, 0x41, 0x80, 0xC3, 0xFF)] == [
        "\x00",
        "\x1a",
        "A",
        FFFD,
        FFFD,
        FFFD,
    ]


def test_byte_fallback_decodes_a_whole_run_at_once(tok: Tokenizer) -> None:
    """Why a byte run is held until a non-byte token ends it: a later invalid byte spoils earlier ones."""
    a = tok.token_to_id("a")
    assert tok.decode(_byte(tok, 0xC3, 0xA9)) == "é"
    assert tok.decode(_byte(tok, 0xC3, 0xA9, 0xFF)) == FFFD * 3  # not "é\ufffd"
    assert tok.decode(_byte(tok, 0x41, 0xFF)) == FFFD * 2  # even an ASCII byte: not "A\ufffd"
    assert tok.decode(_byte(tok, 0xC3, 0xA9) + [a] + _byte(tok, 0xFF)) == "éa" + FFFD
    # With skip_special_tokens the specials are dropped before decoding, so they do not end a run.
    unused = tok.token_to_id("<unused7>")
    assert tok.decode(_byte(tok, 0xC3) + [unused] + _byte(tok, 0xA9), skip_special_tokens=True) == "é"
    assert tok.decode(_byte(tok, 0xC3) + [unused] + _byte(tok, 0xA9)) == FFFD + "<unused7>" + FFFD
    # Streaming: nothing while the run may still change, all of it with the first non-byte token.
    assert _check_stream(tok, _byte(tok, 0xC3, 0xA9) + [a], skip=False) == ["", "", "éa", ""]
    bad = _byte(tok, 0xC3, 0xA9, 0xFF) + [a]
    assert _check_stream(tok, bad, skip=False) == ["", "", "", FFFD * 3 + "a", ""]
    ids = _byte(tok, 0xC3) + [unused] + _byte(tok, 0xA9) + [a]
    assert _check_stream(tok, ids, skip=True) == ["", "", "", "éa", ""]
    assert _check_stream(tok, ids, skip=False) == ["", FFFD + "<unused7>", "", FFFD + "a", ""]


@pytest.mark.parametrize("skip", [False, True])
def test_stream_equals_decode_over_whole_tiny_vocab(tok: Tokenizer, skip: bool) -> None:
    """Random ids over the whole vocab (as a random-weight model samples them), and byte-rich mixes."""
    rng = random.Random(20240312)
    kinds = _kinds(tok)
    unknown = [tok.vocab_size, tok.vocab_size + 7, 10**6]
    pools = [
        list(range(tok.vocab_size)),
        kinds["bytes"],
        kinds["bytes"] + kinds["unused"][:20],
        kinds["bytes"] + kinds["normal"],
        kinds["bytes"] + kinds["named"] + unknown,
        kinds["bytes"][0x80:] + kinds["normal"][:10] + kinds["unused"][:5],
    ]
    for n in range(600):
        pool = pools[n % len(pools)]
        _check_stream(tok, [rng.choice(pool) for _ in range(rng.randint(0, 40))], skip)


@pytest.mark.parametrize(
    "text",
    [
        "é",
        "€",
        "😀",
        "中文",
        "日本語のテキスト",
        "👨‍👩‍👧",
        "naïve café €5 😀!",
        "Pay 5€ to 中文 now",
        "a\u00a0b",
        "Straße 🇩🇪",
    ],
)
def test_multibyte_characters_stream_whole(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert any(i in tok.byte_token_ids for i in ids)  # the tiny vocab spells these with byte fallback
    for skip in (False, True):
        pieces = _check_stream(tok, ids, skip)
        assert "".join(pieces) == text
        assert not any(FFFD in p for p in pieces)


def test_genuine_replacement_character_is_not_held(tok_fffd: Tokenizer) -> None:
    """A U+FFFD that an ordinary token spells is text: it must go out with its token, not wait for flush."""
    tok = tok_fffd
    fffd, x_fffd = tok.token_to_id(FFFD), tok.token_to_id("x" + FFFD)
    assert fffd is not None and x_fffd is not None and fffd not in tok.special_token_ids
    ids = tok.encode("ok " + FFFD, add_special_tokens=False)
    assert ids[-1] == fffd
    assert _check_stream(tok, ids, skip=True)[-2:] == [FFFD, ""]
    # ... also after an invalid byte run, and when only bytes and unused specials follow.
    unused = tok.token_to_id("<unused3>")
    ids = _byte(tok, 0xC3) + [x_fffd] + _byte(tok, 0xE4) + [unused, unused]
    assert _check_stream(tok, ids, skip=True) == ["", FFFD + "x" + FFFD, "", "", "", FFFD]
    rng = random.Random(7)
    pool = list(range(tok.vocab_size)) + [fffd, x_fffd] * 100
    for n in range(300):
        _check_stream(tok, [rng.choice(pool) for _ in range(rng.randint(0, 30))], skip=n % 2 == 0)


def test_byte_level_bpe_still_holds_partial_characters(tok_byte_level: Tokenizer) -> None:
    """Without <0xNN> tokens a trailing U+FFFD may be a character cut between tokens: it stays held."""
    tok = tok_byte_level
    assert not tok.byte_token_ids
    text = "hi 😀 中 ok"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = _check_stream(tok, ids, skip=False)
    assert "".join(pieces) == text and not any(FFFD in p for p in pieces)
    assert "😀" in pieces and "中" in pieces  # each character comes out whole, in one piece
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 20))]
        _check_stream(tok, ids, skip=False)
