"""xgrammar backend: the vocabulary as xgrammar sees it, the compile cache, matchers, token masks, and
model-free random walks through compiled grammars that must always end in valid output."""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from g4serve.processing.tiny_tokenizer import _CORPUS, write_tiny_tokenizer
from g4serve.processing.tokenizer import Tokenizer
from g4serve.structured import (
    AllowedTokenMasks,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredSpec,
    build_allowed_mask,
    detect_vocab_type,
    unpack_bitmask,
)
from g4serve.structured.backend import encoded_vocab

STOP = [1, 6]  # <eos>, <turn|> of the tiny tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def backend(tok) -> StructuredOutputBackend:
    return StructuredOutputBackend(tok, tok.vocab_size, STOP)


# ---- the vocabulary ---------------------------------------------------------------------------------


def test_tiny_vocab_matches_xgrammars_own_hf_detection(tiny_dir, tok, backend):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    theirs = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=STOP)
    assert (backend.vocab_type, backend.add_prefix_space) == ("byte_fallback", False)
    assert theirs.vocab_type == xgr.VocabType.BYTE_FALLBACK and theirs.add_prefix_space is False
    ours, ref = backend.text_info.decoded_vocab, theirs.decoded_vocab
    for i in range(tok.vocab_size):
        if i in tok.special_token_ids or ref[i] == b"\xed":
            assert ours[i] == b"", i  # never chosen by a grammar (stop tokens aside)
        else:
            assert ours[i] == ref[i], (i, ours[i], ref[i])
    assert ref[tok.token_to_id("\u2581the")] == b" the" and ref[tok.token_to_id("<0x0A>")] == b"\n"
    assert (
        backend.json_info.decoded_vocab[tok.token_to_id("<0x0A>")] == b""
    )  # JSON never needs raw control bytes


def _write_variant(out: Path, backend_tok: HFTokenizer, config: dict) -> Tokenizer:
    out.mkdir()
    backend_tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_pretrained(out)


def test_byte_level_vocab_matches_xgrammar(tmp_path):
    """A GPT-2-style byte-level BPE (how other model families spell bytes) is detected as such."""
    transformers = pytest.importorskip("transformers")
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
    assert detect_vocab_type(tok) == ("byte_level", False)
    eos = tok.token_to_id("<|endoftext|>")
    backend = StructuredOutputBackend(tok, tok.vocab_size, [eos])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "bl" / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    theirs = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=[eos])
    assert theirs.vocab_type == xgr.VocabType.BYTE_LEVEL
    ref = theirs.decoded_vocab
    ours = backend.text_info.decoded_vocab
    assert all(ours[i] in (ref[i], b"") for i in range(tok.vocab_size))
    assert sum(ours[i] == ref[i] for i in range(tok.vocab_size)) >= tok.vocab_size - 2  # <|endoftext|>, \xed
    spec = StructuredSpec.regex("[a-z]{3} [0-9]{2}")
    text = _walk(backend, spec, tok, random.Random(0))
    assert text is not None and re.fullmatch("[a-z]{3} [0-9]{2}", text)


def test_prefix_space_detected_like_xgrammar(tmp_path, tiny_dir):
    """Llama-2-style SentencePiece (a "▁" prepended to the text) is told apart from Gemma's (none)."""
    transformers = pytest.importorskip("transformers")
    sp = HFTokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok = _write_variant(
        tmp_path / "sp", sp, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}
    )
    assert detect_vocab_type(tok) == ("byte_fallback", True)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "sp" / "tokenizer.json"), eos_token="<eos>"
    )
    assert xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[1]).add_prefix_space is True


def test_model_vocab_larger_than_tokenizer_is_padded(tok):
    padded = StructuredOutputBackend(tok, tok.vocab_size + 40, STOP)
    tokens = encoded_vocab(tok, tok.vocab_size + 40)
    assert len(tokens) == tok.vocab_size + 40 and tokens[-40:] == [""] * 40
    matcher = padded.new_matcher(StructuredSpec.json_object())
    allowed = build_allowed_mask([matcher], tok.vocab_size + 40)
    assert allowed.shape == (1, tok.vocab_size + 40)
    assert not allowed[0, tok.vocab_size :].any()
    assert allowed[0].nonzero().flatten().tolist() == sorted(
        [tok.token_to_id("{"), tok.token_to_id("<0x7B>")]
    )
    with pytest.raises(ValueError, match="stop_token_ids"):
        StructuredOutputBackend(tok, tok.vocab_size, [])
    with pytest.raises(ValueError, match="stop_token_ids"):
        StructuredOutputBackend(tok, tok.vocab_size, [tok.vocab_size])


# ---- cache and matchers ---------------------------------------------------------------------------------


def test_compile_cache_is_lru_and_thread_safe(tok):
    backend = StructuredOutputBackend(tok, tok.vocab_size, STOP, cache_size=2)
    a, b, c = (StructuredSpec.regex(p) for p in ("a+", "b+", "c+"))
    backend.compile(a)
    backend.compile(b)
    assert backend.compile(StructuredSpec("regex", "a+")) is backend.compile(a)  # equal specs share it
    backend.compile(c)  # evicts b, the least recently used
    assert backend.cache_info() == {"hits": 2, "misses": 3, "size": 2, "max_size": 2}
    backend.compile(a)
    backend.compile(b)
    assert backend.cache_info()["misses"] == 4

    spec = StructuredSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    results, barrier = [], threading.Barrier(8)

    def work():
        barrier.wait()
        results.append(backend.compile(spec))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert backend.cache_info()["misses"] == 5  # compiled once

    errors, barrier = [], threading.Barrier(4)

    def fail():
        barrier.wait()
        try:
            backend.compile(StructuredSpec("regex", "a{"))
        except StructuredOutputError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=fail) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4 and all(e.startswith("response_format.regex: cannot compile") for e in errors)
    assert backend.cache_info()["size"] == 2 and not backend._pending  # failures are not cached


def test_compile_rejects_non_specs_and_bad_grammars(backend):
    with pytest.raises(StructuredOutputError, match="^structured_output: expected a StructuredSpec"):
        backend.compile({"type": "json_object"})
    with pytest.raises(StructuredOutputError, match="^response_format.regex: cannot compile"):
        backend.compile(StructuredSpec("regex", "a{"))  # built directly: checked when compiled


@pytest.mark.parametrize(
    "spec",
    [
        StructuredSpec("grammar", "root ::= root"),
        StructuredSpec("regex", "[^\\x00-\\U0010FFFF]"),
        StructuredSpec.json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
    ],
    ids=["ebnf-self", "regex-empty-class", "schema-self-ref"],
)
def test_a_grammar_no_output_satisfies_is_refused_when_compiled(backend, spec):
    """Admitted, every token of its first step would be masked and the request fail inside the engine."""
    with pytest.raises(StructuredOutputError, match=rf"^{spec.field}: no output satisfies it"):
        backend.compile(spec)
    with pytest.raises(StructuredOutputError, match="no output satisfies it"):  # and again: not cached
        backend.compile(spec)


def test_matcher_accepts_rolls_back_and_terminates(backend, tok):
    m = backend.new_matcher(StructuredSpec.choice(["yes", "no"]))
    yes = tok.encode("yes", add_special_tokens=False)
    assert not m.accept_token(tok.token_to_id("x"))
    assert all(m.accept_token(t) for t in yes) and m.is_completed() and not m.is_terminated()
    m.rollback(len(yes))
    assert m.num_accepted == 0 and not m.is_completed()
    assert all(m.accept_token(t) for t in yes)
    bitmask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    m.fill_allowed(bitmask)
    assert unpack_bitmask(bitmask, tok.vocab_size)[0].nonzero().flatten().tolist() == STOP
    m.fill_allowed(bitmask, allow_stop=False)  # only stop tokens fit: they stay allowed
    assert unpack_bitmask(bitmask, tok.vocab_size)[0].nonzero().flatten().tolist() == STOP
    assert m.accept_token(6) and m.is_terminated()


def test_withheld_stop_tokens(backend, tok):
    """min_tokens / ignore_eos withhold stop tokens while the grammar allows anything else."""
    m = backend.new_matcher(StructuredSpec.regex("[0-9]{1,3}"))
    assert m.accept_token(tok.token_to_id("4"))  # complete, but more digits may follow
    both = build_allowed_mask([m, m, None], tok.vocab_size, allow_stop=[True, False, False])
    assert both[0, STOP].all() and not both[1, STOP].any()
    assert torch.equal(both[0] & ~both[1], torch.isin(torch.arange(tok.vocab_size), torch.tensor(STOP)))
    assert both[2].all()  # unconstrained row
    assert build_allowed_mask([None, None], tok.vocab_size) is None


# ---- bitmask unpacking ----------------------------------------------------------------------------------


def _slow_unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    out = torch.zeros(bitmask.shape[0], vocab_size, dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for t in range(vocab_size):
            out[r, t] = bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 100, 1024])
def test_unpack_matches_slow_reference(vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    words = (vocab_size + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    bitmask[0] = -1
    bitmask[1, 0] = -(2**31)  # only bit 31 of the first word
    assert torch.equal(unpack_bitmask(bitmask, vocab_size), _slow_unpack(bitmask, vocab_size))
    # Big-endian hosts take the shift path: same answer.
    shifts = torch.arange(32, dtype=torch.int32)
    assert torch.equal(
        (((bitmask.unsqueeze(-1) >> shifts) & 1) != 0).view(3, -1)[:, :vocab_size],
        _slow_unpack(bitmask, vocab_size),
    )


def test_mask_builder_matches_per_row_fill(backend, tok):
    specs = [
        StructuredSpec.json_object(),
        StructuredSpec.regex("[a-c]+x"),
        StructuredSpec.choice(["one", "two"]),
    ]
    matchers = [
        backend.new_matcher(specs[i % 3]) if i % 4 else None for i in range(12)
    ]  # >= 8 rows: batched fill
    builder = AllowedTokenMasks(tok.vocab_size, "cpu")
    for _ in range(2):  # the buffer is reused
        allowed = builder(matchers)
        for row, m in enumerate(matchers):
            if m is None:
                assert allowed[row].all()
            else:
                one = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
                m.fill_allowed(one)
                assert torch.equal(allowed[row], unpack_bitmask(one, tok.vocab_size)[0])


# ---- random walks: whatever the model picks, the output is valid -----------------------------------------


def _walk(backend, spec, tok, rng, max_steps=400, budget=None):
    """Sample tokens uniformly among the allowed ones (biased to end sooner, unless a ``budget`` of tokens
    must make it end); the decoded text, or None."""
    m = backend.new_matcher(spec)
    closers = {tok.token_to_id(c) for c in ['"', "}", "]", ","]} - {None}
    out = []
    for _ in range(max_steps if budget is None else budget):
        budgets = None if budget is None else [budget - len(out)]
        allowed = build_allowed_mask([m], backend.vocab_size, budgets=budgets)[0].nonzero().flatten().tolist()
        stops = [t for t in allowed if t in STOP]
        ends = [t for t in allowed if t in closers]
        if stops and budget is None and rng.random() < 0.5:
            token = stops[0]
        elif ends and budget is None and rng.random() < 0.2:
            token = rng.choice(ends)
        else:
            token = rng.choice(allowed)
        assert m.accept_token(token)
        if m.is_terminated():
            return tok.decode(out, skip_special_tokens=True)
        out.append(token)
    return None


FUZZ_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": -5, "maximum": 130},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5},
            "ok": {"type": "boolean"},
            "none": {"type": "null"},
            "kind": {"enum": ['a"b', "c\\d", "é", 3, None]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            },
            "inner": {
                "type": "object",
                "properties": {"x": {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 99}},
                "required": ["x"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "ok", "inner"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[^a-z]{2,5}$"},
    {"type": "string", "maxLength": 6},
    {"type": "string", "format": "date"},
    {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "array", "prefixItems": [{"const": "k"}, {"type": "boolean"}], "items": False},
        ]
    },
    {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "next": {"$ref": "#/$defs/node"},
                },
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    },
    {
        "type": "object",
        "required": ["must"],
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 5},
    },
    {"type": "array", "minItems": 2, "maxItems": 3},
    {
        "type": "object",
        "patternProperties": {"^k[0-9]$": {"type": "boolean"}},
        "additionalProperties": False,
        "maxProperties": 2,
    },
]


@pytest.mark.parametrize("schema", FUZZ_SCHEMAS, ids=range(len(FUZZ_SCHEMAS)))
def test_random_walks_give_valid_json(backend, tok, schema):
    rng = random.Random(len(json.dumps(schema)))
    spec = StructuredSpec.json_schema(schema)
    done = 0
    for _ in range(8):
        text = _walk(backend, spec, tok, rng)
        if text is None:
            continue
        done += 1
        jsonschema.validate(json.loads(text), schema)  # json.loads is strict: no raw control characters
    assert done >= 4


def test_random_walks_regex_choice_and_json_object(backend, tok):
    rng = random.Random(0)
    for _ in range(6):
        text = _walk(backend, StructuredSpec.regex(r"(\+[0-9]{2} )?[A-Z][a-z]{1,4}\.txt"), tok, rng)
        assert re.fullmatch(r"(\+[0-9]{2} )?[A-Z][a-z]{1,4}\.txt", text)
        choices = ["yes", "no", "maybe so", "\u00e9t\u00e9 \U0001f600", 'say "hi"\n']
        assert _walk(backend, StructuredSpec.choice(choices), tok, rng) in choices
        grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | root'
        text = _walk(backend, StructuredSpec.grammar(grammar), tok, rng)
        assert text is None or re.fullmatch(r"[(),0-9]+", text)
    objects = [_walk(backend, StructuredSpec.json_object(), tok, rng) for _ in range(8)]
    assert sum(o is not None for o in objects) >= 4
    assert all(isinstance(json.loads(o), dict) for o in objects if o is not None)


@pytest.mark.parametrize("budget", [3, 10, 40])
def test_budget_closes_the_grammar_in_time(backend, tok, budget):
    """Uniform noise never closes a free string by itself; within ``budget`` tokens the mask steers the
    grammar to its end, so the walk stops in time with valid output."""
    rng = random.Random(budget)
    schema = {
        "type": "object",
        "properties": {"k": {"type": "string"}, "v": {"type": "array", "items": {}}},
        "required": ["k"],
    }
    for _ in range(3):
        text = _walk(backend, StructuredSpec.json_object(), tok, rng, budget=budget)
        assert text is not None and isinstance(json.loads(text), dict)
        if budget >= 20:  # {"k": ""} needs ~10 tokens in the tiny vocabulary
            text = _walk(backend, StructuredSpec.json_schema(schema), tok, rng, budget=budget)
            assert text is not None
            jsonschema.validate(json.loads(text), schema)


def test_forced_closing_beats_withheld_stop(backend, tok):
    m = backend.new_matcher(StructuredSpec.regex("[0-9]{1,9}"))
    assert m.accept_token(tok.token_to_id("4"))
    assert m.forced_token(budget=400) is None  # plenty of room: the model chooses
    allowed = build_allowed_mask([m], tok.vocab_size, allow_stop=[False], budgets=[1])
    assert allowed[0].nonzero().flatten().tolist() == [STOP[0]]  # last token: the grammar ends here
