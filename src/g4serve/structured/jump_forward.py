"""Jump-forward decoding: the text a grammar forces (keys, punctuation, the rest of an enum value once its
prefix is unique) becomes output tokens at once, computed in one forward as a chunk, not one step each.

The forced text (xgrammar's ``find_jump_forward_string``) is tokenized together with the token the model
just sampled, whose K/V is not computed yet, so it can be re-spelled for free (SGLang re-tokenizes too).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch


class StructuredMatcher(Protocol):
    """What planning a jump uses of ``backend.StructuredMatcher`` (which calls in here: a protocol, not an
    import, keeps the two modules out of an import cycle)."""

    vocab: Any  # backend.MatcherVocab: vocab_size, stop_token_ids, stop_keep_mask, jump
    _matcher: Any  # the xgrammar.GrammarMatcher

    def accept_token(self, token_id: int) -> bool: ...

    def accept_forced(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int = 1) -> None: ...

    def is_completed(self) -> bool: ...

    def is_terminated(self) -> bool: ...


class JumpForwardVocab:
    """What jump-forward needs of the vocabulary, shared by all matchers of a backend: the tokenizer's
    ``encode``, each token's bytes as the grammar reads them, and a sorted index of those bytes that finds
    every token extending a given one."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        decoded: Sequence[bytes],
        json_excluded: Sequence[bool] = (),
    ):
        self.encode = encode
        self.decoded = list(decoded)
        # Tokens JSON grammars never take (raw control characters) though other grammars do.
        self.json_excluded = np.zeros(len(self.decoded), dtype=bool)
        self.json_excluded[: len(json_excluded)] = json_excluded
        order = sorted((raw, i) for i, raw in enumerate(self.decoded) if raw)
        self._keys = [raw for raw, _ in order]
        self._ids = np.array([i for _, i in order], dtype=np.int64)

    def tokenize(self, data: bytes) -> list[int] | None:
        """Token ids that spell exactly ``data`` (the tokenizer's own split), or None when its tokens would
        spell other bytes (a normalizer that rewrites text, a special token, an added prefix space) or
        ``data`` is not whole UTF-8."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        ids = self.encode(text)
        if not ids or any(not 0 <= i < len(self.decoded) for i in ids):
            return None
        return ids if b"".join(self.decoded[i] for i in ids) == data else None

    def extensions(self, token_id: int) -> np.ndarray:
        """Ids of the tokens whose bytes start with ``token_id``'s and go on."""
        prefix = self.decoded[token_id]
        lo = bisect.bisect_right(self._keys, prefix)  # past the token itself (and equal spellings)
        hi = bisect.bisect_left(self._keys, _successor(prefix)) if _successor(prefix) else len(self._keys)
        return self._ids[lo:hi]


def _successor(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string starting with ``prefix`` (b"" if none is)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b""


def _allowed(bitmask: torch.Tensor, ids: np.ndarray) -> np.ndarray:
    words = bitmask[0].numpy()
    return ((words[ids >> 5].astype(np.int64) >> (ids & 31)) & 1).astype(bool)


def plan_jump(matcher: StructuredMatcher, sampled: int | None, budget: int) -> list[int]:
    """Advance ``matcher`` over the text its grammar now forces; returns the output tokens that stand for
    ``sampled`` (the token just sampled and accepted; None at admission, before any) and that text, at most
    ``budget`` of them. ``matcher`` ends positioned after them.

    The sampled token's bytes and the forced text are tokenized as one string: where the tokenizer splits
    right after the sampled token, the sample stays as the model chose it; where one of its tokens crosses
    that boundary, the sample is re-spelled with it. When that spelling fails the grammar, the forced text
    is tokenized alone. Once the grammar can only end (nothing but stop tokens allowed), its first allowed
    stop token closes the list: no forward is spent choosing between stop ids.
    """
    vocab = matcher.vocab.jump
    head = [] if sampled is None else [sampled]
    if vocab is None or budget <= len(head) or matcher.is_terminated():  # the model sampled the stop itself
        return head
    try:
        text = matcher._matcher.find_jump_forward_string()
    except UnicodeDecodeError:  # the forced bytes start or end inside a character (after a byte token)
        text = ""
    tokens = head
    if text:
        tokens = _jump_text(matcher, vocab, sampled, text.encode(), budget) or head
    if sampled is not None and len(tokens) < budget and matcher.is_completed():
        stop = _only_stop(matcher)
        if stop is not None and matcher.accept_token(stop):
            tokens = [*tokens, stop]
    return tokens


def _spellings(vocab: JumpForwardVocab, sampled: int | None, forced: bytes) -> list[list[int]]:
    """Token sequences for (the sampled token and) ``forced``, best first."""
    head = b"" if sampled is None else vocab.decoded[sampled]
    spellings = []
    joined = vocab.tokenize(head + forced) if head else None
    if joined is not None:
        cut, covered = 0, 0
        while covered < len(head):
            covered += len(vocab.decoded[joined[cut]])
            cut += 1
        # Where the tokenizer's own spelling splits right after the sampled token, the sample stays as the
        # model chose it (a byte token, say); it is re-spelled only when a token crosses that boundary.
        spellings.append([sampled, *joined[cut:]] if covered == len(head) else joined)
    alone = vocab.tokenize(forced)
    if alone is not None:
        spellings.append([*([] if sampled is None else [sampled]), *alone])
    return spellings


def _jump_text(
    matcher: StructuredMatcher, vocab: JumpForwardVocab, sampled: int | None, forced: bytes, budget: int
) -> list[int] | None:
    """The tokens of (the sampled token's bytes and) ``forced``, accepted; None (matcher unchanged) if no
    spelling of them is found that the grammar takes."""
    spellings = _spellings(vocab, sampled, forced)
    if sampled is not None:
        matcher.rollback(1)  # each spelling spells the sampled token's bytes again, maybe as other tokens
    for spelling in spellings:
        tokens = _take(matcher, vocab, spelling[:budget], len(spelling) > budget, sampled)
        if tokens is not None:
            return tokens
    if sampled is not None:
        restored = matcher.accept_token(sampled)
        assert restored, "the sampled token was accepted a moment ago"
    return None


def _take(
    matcher: StructuredMatcher, vocab: JumpForwardVocab, tokens: list[int], cut: bool, sampled: int | None
) -> list[int] | None:
    """Accept ``tokens`` (all, or all but the last; see below); None (matcher unchanged) if the grammar
    refuses one."""
    if _accept_all(matcher, tokens[:-1]) is None:
        return None
    last = tokens[-1]
    # The forced text's last token is left to the model when a longer token the grammar allows here starts
    # with it: that token would reach into the model's free choice, and the tokenizer's own spelling may well
    # be the longer one (" " then "null" against " null"). Not at a budget cut, and never so far back that
    # the sampled token's bytes would be dropped.
    head = 0 if sampled is None else len(vocab.decoded[sampled])
    covered = sum(len(vocab.decoded[t]) for t in tokens[:-1])
    if not cut and covered >= head and _extendable(matcher, vocab, last):
        return tokens[:-1]
    if matcher.accept_forced(last):
        return tokens
    if len(tokens) > 1:
        matcher.rollback(len(tokens) - 1)
    return None


def take_forced_text(matcher: Any, vocab: JumpForwardVocab, json: bool) -> list[int]:
    """On an ``xgrammar.GrammarMatcher`` (the closing planner's fork; ``json``: compiled on the JSON
    vocabulary): accept the text the grammar forces now and return the tokenizer's spelling of it; []
    (matcher unchanged) when nothing is forced or that spelling is not the grammar's to take."""
    try:
        text = matcher.find_jump_forward_string()
    except UnicodeDecodeError:
        return []
    tokens = vocab.tokenize(text.encode()) if text else None
    if json and tokens and vocab.json_excluded[tokens].any():
        return []
    # The text is what the grammar forces, so it is taken (as one string: the fork is never rolled back);
    # the tokens only count the path's length.
    return tokens if tokens and matcher.accept_string(text) else []


def _accept_all(matcher: StructuredMatcher, tokens: list[int]) -> int | None:
    """Accept every token or none; how many were accepted (None: the grammar refused one)."""
    for n, token in enumerate(tokens):
        if not matcher.accept_forced(token):
            if n:
                matcher.rollback(n)
            return None
    return len(tokens)


def _fill(matcher: StructuredMatcher) -> torch.Tensor:
    bitmask = torch.empty(1, (matcher.vocab.vocab_size + 31) // 32, dtype=torch.int32)
    matcher._matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask


def _extendable(matcher: StructuredMatcher, vocab: JumpForwardVocab, token: int) -> bool:
    """Whether the grammar, where it stands, allows a token that spells ``token`` and more."""
    longer = vocab.extensions(token)
    longer = longer[longer < matcher.vocab.vocab_size]
    return bool(longer.size) and bool(_allowed(_fill(matcher), longer).any())


def _only_stop(matcher: StructuredMatcher) -> int | None:
    """The first stop token when the grammar allows nothing but stop tokens, else None."""
    bitmask = _fill(matcher)
    if bool((bitmask[0] & matcher.vocab.stop_keep_mask).any()):
        return None
    stops = np.array(matcher.vocab.stop_token_ids, dtype=np.int64)
    allowed = stops[_allowed(bitmask, stops)]
    return int(allowed[0]) if allowed.size else None
