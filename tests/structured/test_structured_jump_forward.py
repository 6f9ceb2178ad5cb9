"""Jump-forward planning without a model (``structured/jump_forward.py``): which tokens stand for the forced
text, how they meet the sampled token and the model's next choice, the closing planner taking forced text
whole, and random walks that jump after every token and must still end in valid output whose tokens the
grammar accepts one by one."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from test_structured_backend import FUZZ_SCHEMAS, STOP, _write_variant  # tests/structured is on sys.path
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
from g4serve.processing.tokenizer import Tokenizer
from g4serve.structured import StructuredOutputBackend, StructuredSpec
from g4serve.structured.bitmask import build_allowed_mask
from g4serve.structured.jump_forward import JumpForwardVocab


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def backend(tok) -> StructuredOutputBackend:
    return StructuredOutputBackend(tok, tok.vocab_size, STOP)


def _ids(tok: Tokenizer, *pieces: str) -> list[int]:
    ids = [tok.token_to_id(p) for p in pieces]
    assert None not in ids, pieces
    return ids


# ---- the vocabulary index ---------------------------------------------------------------------------------


def test_extensions_match_brute_force(backend):
    vocab = backend.matcher_vocab.jump
    decoded = vocab.decoded
    for token in range(len(decoded)):
        if not decoded[token]:
            continue
        expected = {
            t
            for t, raw in enumerate(decoded)
            if len(raw) > len(decoded[token]) and raw.startswith(decoded[token])
        }
        assert set(vocab.extensions(token).tolist()) == expected, decoded[token]


def test_extensions_of_bytes_ending_in_ff():
    decoded = [b"", b"a\xff", b"a\xff\x00", b"a\xff\xff", b"b", b"\xff", b"\xff\xfe"]
    vocab = JumpForwardVocab(lambda text: [], decoded)
    assert sorted(vocab.extensions(1).tolist()) == [2, 3]
    assert vocab.extensions(3).tolist() == []
    assert vocab.extensions(5).tolist() == [6]


def test_tokenize_checks_the_bytes(tok, backend):
    vocab = backend.matcher_vocab.jump
    assert vocab.tokenize(b'", "a": ') == tok.encode('", "a": ', add_special_tokens=False)
    assert vocab.tokenize(b"\xc3") is None  # half a character
    assert vocab.tokenize("<eos>x".encode()) is None  # a special token spells no bytes
    spaced = JumpForwardVocab(lambda text: tok.encode(" " + text, add_special_tokens=False), vocab.decoded)
    assert spaced.tokenize(b"ab") is None  # a tokenizer that adds a prefix space spells other bytes


# ---- one jump ----------------------------------------------------------------------------------------------


def test_admission_jump_and_forced_end(backend, tok):
    m = backend.new_matcher(StructuredSpec.choice(["card_lock", "card_unlock"]))
    forced = m.jump_forward(None, budget=100)
    assert tok.decode(forced) == "card_" and forced == tok.encode("card_", add_special_tokens=False)
    lo = tok.token_to_id("lo")
    assert m.accept_token(lo)
    # "lo" + "ck" is spelled "lock" by the tokenizer: the sample is re-spelled with the forced text, then the
    # grammar can only end, so its first stop token closes the jump.
    assert m.jump_forward(lo, budget=100) == [*_ids(tok, "lock"), STOP[0]]
    assert m.is_terminated()


def test_a_clean_boundary_keeps_the_sampled_token(backend, tok):
    m = backend.new_matcher(StructuredSpec.regex("[0-9];x"))
    assert m.jump_forward(None, budget=10) == []  # a free choice comes first
    byte5 = tok.token_to_id("<0x35>")
    assert m.accept_token(byte5)
    # The tokenizer spells "5;x" as "5", ";", "x": it splits after the "5", so the model's byte token stays.
    assert m.jump_forward(byte5, budget=10) == [byte5, *_ids(tok, ";", "x"), STOP[0]]


def test_a_mergeable_tail_is_left_to_the_model(backend, tok):
    """ " the" is forced, but " they" is allowed and would spell it and more: the model chooses."""
    m = backend.new_matcher(StructuredSpec.choice([" they", " the x"]))
    assert m.jump_forward(None, budget=10) == []
    allowed = build_allowed_mask([m], tok.vocab_size)[0]
    assert allowed[tok.token_to_id("\u2581they")] and allowed[tok.token_to_id("\u2581the")]
    m2 = backend.new_matcher(StructuredSpec.choice([" the x", " the y"]))  # nothing extends " the ": forced
    assert tok.decode(m2.jump_forward(None, budget=10)).startswith(" the")


def test_forced_tokens_keep_to_the_json_vocabulary(backend, tok):
    """Forced tokens are taken by their bytes, without xgrammar's vocabulary check: JSON grammars must still
    never take a raw control character, even where a pattern asks for one (JSON could not parse it)."""
    newline, quote, a = tok.token_to_id("<0x0A>"), tok.token_to_id('"'), tok.token_to_id("a")
    spec = StructuredSpec.json_schema({"type": "string", "pattern": "^a\nb$"})
    m = backend.new_matcher(spec)
    assert m.accept_forced(quote) and m.accept_forced(a)
    assert not m.accept_forced(newline) and not m.accept_token(newline)
    text = backend.new_matcher(StructuredSpec.regex("a\nb"))
    assert text.accept_forced(a) and text.accept_forced(newline)  # text grammars take it
    jumped = backend.new_matcher(spec).jump_forward(None, budget=10)
    assert b"\n" not in b"".join(backend.matcher_vocab.jump.decoded[t] for t in jumped)
    closing = backend.new_matcher(spec)  # nor does the budget's closing path, which takes forced text whole
    assert closing.forced_token(budget=3) is None and closing._closing[1] is None


def test_closing_path_takes_forced_text_whole(backend, tok):
    """The budget's closing path spells forced text as the tokenizer does, in one step per stretch: a valid
    way to the end, as short as the greedy token-by-token walk or shorter."""
    schema = {
        "type": "object",
        "properties": {"intent": {"enum": ["card_lock", "transfer_money"]}, "n": {"enum": ["c1", None]}},
        "required": ["intent", "n"],
        "additionalProperties": False,
    }
    m = backend.new_matcher(StructuredSpec.json_schema(schema))
    assert m.forced_token(budget=40) is not None  # tight: the closing starts now
    path = m._closing[1]
    replay = backend.new_matcher(StructuredSpec.json_schema(schema))
    assert all(replay.accept_token(t) for t in path) and replay.is_completed()
    text = tok.decode(path)
    assert text.startswith('{"intent": "') and '", "n": ' in text and len(path) < len(text)


def test_a_sampled_stop_token_ends_without_a_jump(backend, tok):
    """Where the grammar may end or go on, the model decides: a stop token it samples is taken as is."""
    m = backend.new_matcher(StructuredSpec.regex("[0-9]{1,9}"))
    four = tok.token_to_id("4")
    assert m.accept_token(four) and m.jump_forward(four, budget=10) == [four]
    assert m.accept_token(STOP[1]) and m.jump_forward(STOP[1], budget=10) == [STOP[1]]
    assert m.is_terminated()


def test_forced_text_inside_a_character_is_not_jumped(backend, tok):
    """ "été" and "ète" share the first byte of "é" and "è" only: that forced byte is no text to tokenize, so
    there is no jump; once the model has written the first byte, the rest of "été" is forced."""
    spec = StructuredSpec.choice(["\u00e9t\u00e9", "\u00e8te"])
    m = backend.new_matcher(spec)
    assert m.jump_forward(None, budget=10) == []
    first = tok.token_to_id("<0xC3>")
    assert m.accept_token(first)
    assert m.jump_forward(first, budget=10) == [first]  # "\xa9" or "\xa8" next: a choice, inside "é"
    second = tok.token_to_id("<0xA9>")
    assert m.accept_token(second)
    tokens = m.jump_forward(second, budget=10)
    assert tokens[0] == second and tokens[-1] == STOP[0]
    assert tok.decode([first, *tokens[:-1]]) == "\u00e9t\u00e9"


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_budget_caps_the_jump(backend, tok, budget):
    m = backend.new_matcher(StructuredSpec.json_schema({"enum": ["transfer_money"]}))
    t = tok.token_to_id('"')
    assert m.accept_token(t)
    tokens = m.jump_forward(t, budget=budget)
    assert 1 <= len(tokens) <= budget and tokens[0] == t
    replay = backend.new_matcher(StructuredSpec.json_schema({"enum": ["transfer_money"]}))
    assert all(replay.accept_token(x) for x in tokens)
    assert replay.num_accepted == m.num_accepted  # the matcher stands right after the returned tokens


def test_refused_spelling_leaves_the_matcher_unchanged(backend, tok):
    """JSON grammars refuse tokens holding control characters: a forced text the tokenizer spells with one
    cannot be taken, and the sampled token stays accepted as it was."""
    m = backend.new_matcher(StructuredSpec.regex("ab[0-9]"))
    a = tok.token_to_id("a")
    assert m.accept_token(a)
    vocab = m.vocab.jump
    original = vocab.encode
    vocab.encode = lambda text: _ids(tok, "<0x0A>")  # a spelling of other bytes
    try:
        assert m.jump_forward(a, budget=10) == [a]
    finally:
        vocab.encode = original
    assert m.num_accepted == 1 and m.accept_token(tok.token_to_id("b"))


# ---- random walks ------------------------------------------------------------------------------------------


def _jump_walk(backend, spec, tok, rng, max_steps=300, budget=400):
    """Sample uniformly among the allowed tokens (biased to end sooner), jumping after every token; returns
    (output tokens, text, samples) or None if the walk did not end."""
    m = backend.new_matcher(spec)
    out = m.jump_forward(None, budget - 1)
    samples = 0
    for _ in range(max_steps):
        allowed = build_allowed_mask([m], backend.vocab_size, budgets=[budget - len(out)])[0]
        allowed = allowed.nonzero().flatten().tolist()
        stops = [t for t in allowed if t in STOP]
        token = stops[0] if stops and rng.random() < 0.5 else rng.choice(allowed)
        assert m.accept_token(token)
        samples += 1
        tokens = m.jump_forward(token, budget - len(out))
        out += tokens
        assert len(out) <= budget
        if m.is_terminated():
            assert out[-1] in STOP and not any(t in STOP for t in out[:-1])
            return out, tok.decode(out[:-1], skip_special_tokens=True), samples
    return None


def _replays(backend, spec, tokens) -> bool:
    m = backend.new_matcher(spec)
    return all(m.accept_token(t) for t in tokens) and m.is_terminated()


@pytest.mark.parametrize("schema", FUZZ_SCHEMAS, ids=range(len(FUZZ_SCHEMAS)))
def test_jumping_walks_give_valid_json(backend, tok, schema):
    rng = random.Random(len(json.dumps(schema)))
    spec = StructuredSpec.json_schema(schema)
    done = 0
    for _ in range(8):
        walk = _jump_walk(backend, spec, tok, rng)
        if walk is None:
            continue
        tokens, text, samples = walk
        done += 1
        jsonschema.validate(json.loads(text), schema)
        assert _replays(backend, spec, tokens)  # a fresh matcher takes the same tokens one by one
        assert samples <= len(tokens)
    assert done >= 4


def test_jumping_walks_on_other_tokenizers(tmp_path, tiny_dir):
    """A Llama-2-style tokenizer that prepends "▁" to every encoded text spells
    other bytes than the forced text, so its jumps are refused: it decodes every token (but a forced end)."""
    sp = HFTokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    prefixed = _write_variant(
        tmp_path / "sp", sp, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}
    )
    schema = {
        "type": "object",
        "properties": {"intent": {"enum": ["card_lock", "card_unlock"]}},
        "required": ["intent"],
        "additionalProperties": False,
    }
    spec = StructuredSpec.json_schema(schema)
    backend = StructuredOutputBackend(prefixed, prefixed.vocab_size, STOP)
    rng = random.Random(0)
    for _ in range(4):
        tokens, text, samples = _jump_walk(backend, spec, prefixed, rng)
        jsonschema.validate(json.loads(text), schema)
        assert len(tokens) - samples <= 1 and _replays(backend, spec, tokens)  # at most the forced end


def test_jumping_walks_with_byte_level_bpe(tmp_path):
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    from g4serve.processing.tiny_tokenizer import _CORPUS

    bl = HFTokenizer(models.BPE())
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    bl.train_from_iterator(
        [_CORPUS],
        BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = _write_variant(
        tmp_path / "bl", bl, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    )
    eos = tok.token_to_id("<|endoftext|>")
    backend = StructuredOutputBackend(tok, tok.vocab_size, [eos])
    schema = {
        "type": "object",
        "properties": {
            "card": {"enum": ["debit", "credit"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["card", "n"],
        "additionalProperties": False,
    }
    spec = StructuredSpec.json_schema(schema)
    rng = random.Random(1)
    m = backend.new_matcher(spec)
    assert tok.decode(m.jump_forward(None, 100)) == '{"card": "'
    for _ in range(4):
        matcher = backend.new_matcher(spec)
        out = matcher.jump_forward(None, 99)
        while not matcher.is_terminated():
            allowed = build_allowed_mask([matcher], backend.vocab_size)[0].nonzero().flatten().tolist()
            token = rng.choice(allowed)
            assert matcher.accept_token(token)
            out += matcher.jump_forward(token, 99 - len(out))
        jsonschema.validate(json.loads(tok.decode(out[:-1], skip_special_tokens=True)), schema)
        assert out[-1] == eos


def test_regex_choice_and_grammar_walks(backend, tok):
    rng = random.Random(0)
    pattern = r"(\+[0-9]{2} )?[A-Z][a-z]{1,4}\.txt"
    choices = ["yes", "no", "maybe so", "\u00e9t\u00e9 \U0001f600", 'say "hi"\n']
    for _ in range(6):
        tokens, text, _ = _jump_walk(backend, StructuredSpec.regex(pattern), tok, rng)
        assert re.fullmatch(pattern, text)
        tokens, text, _ = _jump_walk(backend, StructuredSpec.regex("[0-9]{1,9}"), tok, rng)  # may end early
        assert re.fullmatch("[0-9]{1,9}", text)
        tokens, text, _ = _jump_walk(backend, StructuredSpec.choice(choices), tok, rng)
        assert text in choices


def test_allowed_bits_helper_matches_mask(backend):
    from g4serve.structured.jump_forward import _allowed

    m = backend.new_matcher(StructuredSpec.regex("[a-c]x"))
    bitmask = torch.empty(1, (backend.vocab_size + 31) // 32, dtype=torch.int32)
    m._matcher.fill_next_token_bitmask(bitmask, 0)
    ids = np.arange(backend.vocab_size, dtype=np.int64)
    expected = build_allowed_mask([m], backend.vocab_size)[0].numpy()
    assert (_allowed(bitmask, ids) == expected).all()
