"""xgrammar behind g4serve's tokenizer: the token vocabulary as xgrammar sees it, a thread-safe LRU cache
of compiled grammars, and per-request matchers that say which tokens may come next.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from g4serve.processing.tokenizer import Tokenizer
from g4serve.structured.jump_forward import JumpForwardVocab, plan_jump, take_forced_text
from g4serve.structured.spec import StructuredOutputError, StructuredSpec, build_grammar, clean_xgrammar_error

if TYPE_CHECKING:
    import xgrammar

BYTE_FALLBACK, BYTE_LEVEL, RAW = "byte_fallback", "byte_level", "raw"
JSON_KINDS = ("json_object", "json_schema")  # specs compiled on the JSON vocabulary (no control characters)


def detect_vocab_type(tokenizer: Tokenizer) -> tuple[str, bool]:
    """How the vocabulary spells bytes, and whether encoding prepends a space to the text.

    Gemma (SentencePiece-style BPE) spells a space "▁" and keeps 256 byte tokens ``<0x00>``..``<0xFF>``
    for what its merges do not cover (byte fallback); GPT-2-style vocabularies map every byte to a
    printable character (byte level). Gemma's normalizer does not prepend "▁"; older SentencePiece
    models (Llama 2) do, which the encoding of "a" shows.
    """
    vocab = tokenizer.get_vocab()
    backend = tokenizer.backend
    byte_pieces = sum(f"<0x{b:02X}>" in vocab for b in range(256))
    if byte_pieces >= 128 or getattr(backend.model, "byte_fallback", False):
        kind = BYTE_FALLBACK
    elif _uses_byte_level(backend):
        kind = BYTE_LEVEL
    else:
        kind = RAW
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("a", add_special_tokens=False))
    prefix = {BYTE_FALLBACK: "\u2581", BYTE_LEVEL: "\u0120"}.get(kind)
    add_prefix_space = bool(prefix and tokens and tokens[0] and tokens[0].startswith(prefix))
    return kind, add_prefix_space


def _uses_byte_level(backend: Any) -> bool:
    # A component's state is its tokenizer.json entry; nested ones (Sequence) included.
    return any(
        c is not None and b'"type":"ByteLevel"' in c.__getstate__()
        for c in (backend.decoder, backend.pre_tokenizer)
    )


def encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Token strings by id, ``vocab_size`` long. Special tokens (dropped from decoded text) and ids
    past the tokenizer's vocabulary are "": xgrammar never allows those, except the stop tokens."""
    tokens = [""] * vocab_size
    special = tokenizer.special_token_ids
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special:
            tokens[i] = token
    return tokens


def _unsafe_token(raw: bytes, json_only: bool) -> bool:
    """Tokens a grammar must never choose.

    xgrammar accepts UTF-8-encoded surrogates (ED A0..BF ..) as characters; the decoder turns such a
    byte run, and any byte token inside it (a closing quote too), into U+FFFD, so text and grammar would
    disagree. A token that could start one (ending in ED) or holds one is excluded; U+D000..U+D7FF then
    come only from whole tokens. JSON output needs no control characters at all (whitespace is fixed
    and strings escape them), yet xgrammar lets some string rules (maxLength, patterns) take them raw,
    which JSON parsers reject: for JSON, tokens holding one are excluded too.
    """
    return bool(_SURROGATE.search(raw) or (json_only and _CONTROL.search(raw)))


_SURROGATE = re.compile(rb"\xed(?:[\xa0-\xbf]|\Z)")
_CONTROL = re.compile(rb"[\x00-\x1f]")


# Budget-aware closing: near max_tokens a matcher checks whether the grammar can still end in time and,
# when it must, forces a short way out. Checks start CLOSE_WINDOW tokens (plus the grammar's own minimal
# length) before the end and grow denser as the slack shrinks; CLOSE_SLACK tokens are kept in reserve.
CLOSE_WINDOW = 64
CLOSE_SLACK = 16
MAX_CLOSING_PLAN = 512


@dataclass(frozen=True)
class MatcherVocab:
    """What all matchers of one backend share about the vocabulary."""

    vocab_size: int
    stop_token_ids: tuple[int, ...]
    stop_keep_mask: torch.Tensor  # [words] int32: every bit but the stop tokens'
    closing_order: tuple[int, ...]  # tokens that end structures soonest, best first (stop tokens first)
    closing_order_in_text: tuple[int, ...]  # the same inside a string: '"' before '}' and ']'
    text_probes: tuple[int, ...]  # letters allowed only inside strings: where they fit, we are in one
    closing_score: np.ndarray  # [vocab_size] int32: when no closer fits, the closing takes the best-scored
    jump: JumpForwardVocab | None = None  # jump-forward decoding's view of the vocabulary


class StructuredMatcher:
    """One request's position in its grammar. Not thread-safe: the engine thread alone drives it."""

    __slots__ = ("_check_below", "_closing", "_last_token", "_matcher", "num_accepted", "spec", "vocab")

    def __init__(self, spec: StructuredSpec, matcher: xgrammar.GrammarMatcher, vocab: MatcherVocab):
        self.spec = spec
        self._matcher = matcher
        self.vocab = vocab
        self.num_accepted = 0
        self._last_token = -1
        self._closing: tuple[int, list[int] | None] | None = None  # (num_accepted, path) last planned
        self._check_below: int | None = None  # plan the closing once the budget is at most this

    @property
    def stop_keep_mask(self) -> torch.Tensor:
        return self.vocab.stop_keep_mask

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not allow it."""
        ok = self._matcher.accept_token(int(token_id))
        if ok:
            self.num_accepted += 1
            self._last_token = int(token_id)
        return ok

    def accept_forced(self, token_id: int) -> bool:
        """``accept_token`` for a token of a spelling ``JumpForwardVocab.tokenize`` verified, by its bytes
        (one rollback step, as ``accept_token``). xgrammar's ``accept_token`` scans the special tokens, which
        a vocabulary padded past its tokenizer (a preset on the tiny tokenizer: 261k empty ids) makes cost
        ~100 us a token, against ~2.5 us. The grammar's vocabulary is checked here instead: JSON grammars
        never take a token holding a control character (``_unsafe_token``)."""
        jump = self.vocab.jump
        if self.spec.kind in JSON_KINDS and jump.json_excluded[token_id]:
            return False
        ok = self._matcher.accept_string(jump.decoded[token_id])
        if ok:
            self.num_accepted += 1
            self._last_token = int(token_id)
        return ok

    def jump_forward(self, sampled: int | None, budget: int) -> list[int]:
        """Advance over the text the grammar forces now; the output tokens that stand for ``sampled`` (just
        accepted; None before the first token) and that text, at most ``budget`` of them
        (``jump_forward.plan_jump``)."""
        return plan_jump(self, sampled, budget)

    def fill_allowed(
        self, bitmask: torch.Tensor, row: int = 0, allow_stop: bool = True, budget: int | None = None
    ) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (xgrammar's packed int32 layout: bit
        ``t % 32`` of word ``t // 32``). With ``allow_stop=False`` stop tokens are withheld unless
        nothing else is allowed: the grammar's end always wins. ``budget`` (tokens left, this one
        included) lets the grammar close in time: see ``forced_token``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        forced = self.forced_token(budget) if budget is not None else None
        if forced is not None:
            force_token(bitmask, row, forced)
        elif not allow_stop:
            withhold_stop_tokens(bitmask, [row], self.stop_keep_mask)

    def forced_token(self, budget: int) -> int | None:
        """The token to take now so that the output still completes within ``budget`` tokens, or None
        while there is slack. The closing path is greedy (closers such as ``"``, ``}``, ``]`` first, then
        separators, short values, long tokens): not always the shortest, but a valid way to the end. It
        suits JSON; where it finds no way out (some regexes and grammars) the model keeps the choice."""
        if self._check_below is None:
            first = self._closing_path(min(budget, MAX_CLOSING_PLAN))
            # No greedy way out of this grammar (e.g. a regex the greedy walk loops in): leave it to the
            # model.
            self._check_below = CLOSE_WINDOW + len(first) if first is not None else 0
        if budget > self._check_below:
            return None
        path = self._closing_path(budget)
        if path is None:  # too late, or the walk loops from here: forcing would not help; look again later
            self._check_below = budget - max(1, budget // 8)
            return None
        slack = budget - (len(path) + 1 + CLOSE_SLACK)
        if slack > 0:
            # One free token seldom lengthens the way out by more than the reserve (an optional key spelled
            # in a few tokens does): check again after a quarter of the slack.
            self._check_below = budget - max(1, slack // 4)
            return None
        return path[0] if path else self.vocab.stop_token_ids[0]

    def _closing_path(self, budget: int) -> list[int] | None:
        """Tokens (stop token excluded) of the greedy closing from here, or None if longer than budget - 1."""
        if self._closing is not None:
            at, path = self._closing
            # Greedy closing is a function of the state: after taking its first token, the rest still holds.
            if at == self.num_accepted:
                return path if path is None or len(path) < budget else None
            if path and at + 1 == self.num_accepted and self._last_token == path[0]:
                self._closing = (self.num_accepted, path[1:])
                return path[1:]
        sim = self._matcher.fork()
        path: list[int] | None = []
        while True:
            # Forced text (keys, punctuation) is taken whole, as the tokenizer spells it: one mask fill and a
            # pass over the vocabulary per token would cost ~0.5 ms each on a 262k vocabulary.
            jump, json = self.vocab.jump, self.spec.kind in JSON_KINDS
            forced = take_forced_text(sim, jump, json) if jump is not None else []
            if forced:
                if len(path) + len(forced) + 1 > budget:
                    path = None
                    break
                path += forced
                continue
            token = self._closing_step(sim)
            if token in self.vocab.stop_token_ids:
                break
            if token is None or len(path) + 2 > budget:  # no room left for this token and a stop token
                path = None
                break
            sim.accept_token(token)
            path.append(token)
        self._closing = (self.num_accepted, path)
        return path

    def _closing_step(self, matcher) -> int | None:
        words = (self.vocab.vocab_size + 31) // 32
        bitmask = torch.empty(1, words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(bitmask, 0)
        row = bitmask[0].numpy()
        in_text = any((int(row[t >> 5]) >> (t & 31)) & 1 for t in self.vocab.text_probes)
        for t in self.vocab.closing_order_in_text if in_text else self.vocab.closing_order:
            if (int(row[t >> 5]) >> (t & 31)) & 1:
                return t
        # Only the words with a bit set: a choice among a few tokens of a 262k vocabulary reads 32 of them.
        words = np.flatnonzero(row)
        bits = (row[words, None].astype(np.int64) >> np.arange(32)) & 1
        allowed = (words[:, None] * 32 + np.arange(32))[bits.astype(bool)]
        allowed = allowed[allowed < self.vocab.vocab_size]
        if not allowed.size:
            return None
        return int(allowed[np.argmax(self.vocab.closing_score[allowed])])

    def allows_nothing(self) -> bool:
        """Whether no token may come next, not even a stop (a grammar with no way on from here: every row
        of its mask is empty and the sampler's pick cannot be accepted). Fills a mask: for failures only."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab.vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any()) and not self._matcher.is_terminated()

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the output so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last ``num_tokens`` accepted tokens (cheap: xgrammar keeps the history)."""
        self._matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens
        self._last_token = -1
        self._closing = None


def withhold_stop_tokens(bitmask: torch.Tensor, rows: list[int], stop_keep_mask: torch.Tensor) -> None:
    """Clear the stop-token bits of ``bitmask[rows]``, except in rows where nothing else is allowed."""
    filled = bitmask[rows]
    cleared = filled & stop_keep_mask
    bitmask[rows] = torch.where(cleared.any(dim=1, keepdim=True), cleared, filled)


def force_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Allow only ``token`` in ``bitmask[row]``."""
    bitmask[row] = 0
    bitmask[row, token >> 5] = _int32(1 << (token & 31))


def stop_keep_mask(stop_token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``[ceil(V/32)]`` int32 with every bit set but those of ``stop_token_ids``."""
    words = [-1] * ((vocab_size + 31) // 32)
    for t in stop_token_ids:
        words[t >> 5] = _int32((words[t >> 5] & 0xFFFFFFFF) & ~(1 << (t & 31)))
    return torch.tensor(words, dtype=torch.int32)


def closing_orders(decoded: Sequence[bytes], stop_token_ids: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Tokens that bring a (JSON) output to its end soonest, best first: stop tokens; closers made only of
    ``}]`` and ``"`` (longest first; inside a string the ones with a quote lead, elsewhere the others: a
    quote there would open a string); separators; colons; short values. Also the probe letters that tell
    a string apart. Other grammars fall through to ``closing_score``."""
    brackets, quotes, separators, colons, values, probes = [], [], [], [], [], []
    value_rank = {b"null": 0, b"0": 1, b'""': 2, b"false": 3, b"true": 4, b"[]": 5, b"{}": 6}
    for t, raw in enumerate(decoded):
        if not raw or t in stop_token_ids:
            continue
        if not raw.strip(b'"}]'):
            (quotes if b'"' in raw else brackets).append((-len(raw), t))
        elif raw in (b",", b", "):
            separators.append((len(raw), t))
        elif b":" in raw and not raw.strip(b'": '):
            colons.append((-len(raw), t))
        elif raw in value_rank:
            values.append((value_rank[raw], t))
        elif raw in (b"q", b"x", b"z", b"Q", b"X", b"Z"):
            probes.append(t)

    def order(*groups: list) -> tuple[int, ...]:
        return (*stop_token_ids, *(t for group in groups for _, t in sorted(group)))

    return (
        order(brackets, quotes, separators, colons, values),
        order(quotes, brackets, separators, colons, values),
        tuple(probes),
    )


def closing_score(decoded: Sequence[bytes]) -> np.ndarray:
    """Longer tokens cross forced text (keys, enum values) in fewer steps; tokens that open or continue a
    structure (``,``, ``{``, ``[``) come last."""
    return np.array([-1 if _OPENS.search(raw) else len(raw) for raw in decoded], dtype=np.int32)


_OPENS = re.compile(rb"[,{\[]")


def _int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


class StructuredOutputBackend:
    """Compiles ``StructuredSpec`` s for one tokenizer and model vocabulary and hands out matchers.

    ``vocab_size`` is the model's (logits width), which may exceed the tokenizer's; ``stop_token_ids``
    (the model's EOS ids) end every grammar. Compiled grammars are cached (LRU of ``cache_size``
    entries, keyed by the spec); ``compile`` and ``new_matcher`` may be called from any thread.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = 256,
        compile_threads: int = 2,
    ):
        import xgrammar as xgr

        stop = sorted({int(t) for t in stop_token_ids})
        if not stop:
            raise ValueError("stop_token_ids: constrained decoding needs at least one stop (EOS) token id")
        if any(not 0 <= t < vocab_size for t in stop):
            raise ValueError(f"stop_token_ids: {stop} must lie in [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.stop_token_ids = stop
        self.vocab_type, self.add_prefix_space = detect_vocab_type(tokenizer)
        self.cache_size = cache_size
        self._xgr = xgr
        vocab_type = {
            BYTE_FALLBACK: xgr.VocabType.BYTE_FALLBACK,
            BYTE_LEVEL: xgr.VocabType.BYTE_LEVEL,
            RAW: xgr.VocabType.RAW,
        }[self.vocab_type]
        tokens = encoded_vocab(tokenizer, vocab_size)
        full = self._info(tokens, vocab_type)
        decoded = full.decoded_vocab
        text_tokens = ["" if t and _unsafe_token(raw, False) else t for t, raw in zip(tokens, decoded)]
        json_tokens = ["" if t and _unsafe_token(raw, True) else t for t, raw in zip(tokens, decoded)]
        self.text_info = self._info(text_tokens, vocab_type)
        self.json_info = self._info(json_tokens, vocab_type)
        # Our LRU is the cache; xgrammar's own would grow without bound.
        self._compilers = {
            info_name: xgr.GrammarCompiler(info, max_threads=compile_threads, cache_enabled=False)
            for info_name, info in (("text", self.text_info), ("json", self.json_info))
        }
        text_decoded = self.text_info.decoded_vocab
        self.matcher_vocab = MatcherVocab(
            vocab_size,
            tuple(stop),
            stop_keep_mask(stop, vocab_size),
            *closing_orders(text_decoded, stop),
            closing_score(text_decoded),
            JumpForwardVocab(
                lambda text: tokenizer.encode(text, add_special_tokens=False),
                text_decoded,
                [bool(t) and not j for t, j in zip(text_decoded, self.json_info.decoded_vocab)],
            ),
        )
        self._cache: OrderedDict[StructuredSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._pending: dict[StructuredSpec, Future] = {}  # specs being compiled now
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0

    def _info(self, tokens: list[str], vocab_type) -> xgrammar.TokenizerInfo:
        return self._xgr.TokenizerInfo(
            tokens,
            vocab_type,
            vocab_size=self.vocab_size,
            stop_token_ids=self.stop_token_ids,
            add_prefix_space=self.add_prefix_space,
        )

    def compile(self, spec: StructuredSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); StructuredOutputError if it cannot be compiled.
        Concurrent calls for one new spec compile it once; cache hits never wait for another compile."""
        if not isinstance(spec, StructuredSpec):
            raise StructuredOutputError(
                f"structured_output: expected a StructuredSpec, got {type(spec).__name__}"
            )
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.cache_hits += 1
                return compiled
            pending = self._pending.get(spec)
            owner = pending is None
            if owner:
                self.cache_misses += 1
                pending = self._pending[spec] = Future()
            else:
                self.cache_hits += 1
        if not owner:
            return pending.result()  # re-raises the owner's StructuredOutputError
        try:
            compiled = self._compile_uncached(spec)
        except BaseException as exc:
            with self._lock:
                del self._pending[spec]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[spec]
            self._cache[spec] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        pending.set_result(compiled)
        return compiled

    def _compile_uncached(self, spec: StructuredSpec) -> xgrammar.CompiledGrammar:
        grammar = build_grammar(spec)
        compiler = self._compilers["json" if spec.kind in JSON_KINDS else "text"]
        try:
            compiled = compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise StructuredOutputError(
                f"{spec.field}: cannot compile: {clean_xgrammar_error(exc)}"
            ) from None
        first = self._xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)
        if StructuredMatcher(spec, first, self.matcher_vocab).allows_nothing():
            # (``root ::= root``, a regex of an empty class, a schema that only refers to itself): admitted,
            # every token of the first step would be masked and the request fail in the engine
            raise StructuredOutputError(
                f"{spec.field}: no output satisfies it (the grammar allows no first token, not even the end)"
            )
        return compiled

    def cached(self, spec: StructuredSpec) -> bool:
        """Whether ``spec``'s grammar is compiled already (``compile`` then returns at once)."""
        with self._lock:
            return spec in self._cache

    def new_matcher(self, spec: StructuredSpec) -> StructuredMatcher:
        matcher = self._xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=self.stop_token_ids)
        return StructuredMatcher(spec, matcher, self.matcher_vocab)

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.cache_hits,
                "misses": self.cache_misses,
                "size": len(self._cache),
                "max_size": self.cache_size,
            }
