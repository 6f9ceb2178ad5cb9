"""Thinking before a constrained answer: Gemma 4 may open its thought channel (``<|channel>thought\\n...
<channel|>``) before it answers. ``ThoughtGate`` wraps a request's grammar (or none) so that the thought is
free, the grammar starts from its root on the token after the closing marker, and the channel is closed by
force once ``max_reasoning_tokens`` are spent (or when the answer would no longer fit in ``max_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from g4serve.structured.backend import StructuredMatcher, _int32, force_token, withhold_stop_tokens

THOUGHT_OPEN_TOKEN, THOUGHT_CLOSE_TOKEN = "<|channel>", "<channel|>"

# Where a request stands: before any thought (the channel may still open), inside it, after it.
START, THOUGHT, ANSWER = "start", "thought", "answer"


@dataclass(frozen=True)
class ThoughtMarkers:
    """The token ids of the thought channel's opening and closing markers."""

    open_id: int
    close_id: int


def thought_markers(tokenizer) -> ThoughtMarkers | None:
    """The tokenizer's thought-channel marker ids, or None when it has no such tokens."""
    open_id, close_id = tokenizer.token_to_id(THOUGHT_OPEN_TOKEN), tokenizer.token_to_id(THOUGHT_CLOSE_TOKEN)
    return None if open_id is None or close_id is None else ThoughtMarkers(open_id, close_id)


def reasoning_token_count(token_ids: list[int], markers: ThoughtMarkers) -> int:
    """Output tokens that belong to the thought channel, its markers included (OpenAI's
    ``completion_tokens_details.reasoning_tokens``): from the first opening marker to the first closing one,
    or to the end when it never closed."""
    try:
        start = token_ids.index(markers.open_id)
    except ValueError:
        return 0
    try:
        end = token_ids.index(markers.close_id, start) + 1
    except ValueError:
        end = len(token_ids)
    return end - start


class ThoughtGate:
    """A request's grammar state with a thought channel in front: the ``StructuredMatcher`` interface the
    engine, the mask builder and jump-forward use. Not thread-safe: the engine thread alone drives it.

    - start: the model opens the channel, or answers at once (then under ``inner`` from the first token);
    - thought: every token is allowed but a second opening marker, and stop tokens when an answer grammar
      must follow; the closing marker is forced after ``max_reasoning_tokens`` thought tokens (its label
      ``thought\\n`` included), or as soon as the answer grammar needs the rest of ``max_tokens`` to complete;
    - answer: ``inner`` from its root; without one, anything but a second thought channel.
    """

    def __init__(
        self,
        markers: ThoughtMarkers,
        inner: StructuredMatcher | None,
        max_reasoning_tokens: int | None = None,
    ):
        self.markers = markers
        self.inner = inner
        self.spec = inner.spec if inner is not None else None
        self.vocab = inner.vocab if inner is not None else None
        self.max_reasoning_tokens = max_reasoning_tokens
        self.state = START
        self.num_reasoning_tokens = 0  # thought tokens after the opening marker, the closing one excluded
        self.num_accepted = 0
        # Before each accepted token: (state, num_reasoning_tokens, whether inner accepted it), for rollback.
        self._history: list[tuple[str, int, bool]] = []

    @property
    def stop_keep_mask(self) -> torch.Tensor:
        return self.inner.stop_keep_mask

    # ---- advancing ------------------------------------------------------------------------------------
    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        before = (self.state, self.num_reasoning_tokens)
        took = False
        if self.state == START and token_id == self.markers.open_id:
            self.state = THOUGHT
        elif self.state == THOUGHT:
            if token_id == self.markers.close_id:
                self.state = ANSWER
            else:
                self.num_reasoning_tokens += 1
        elif self.inner is not None:  # the answer (perhaps at once, from the start)
            if not self.inner.accept_token(token_id):
                return False
            self.state, took = ANSWER, True
        self._history.append((*before, took))
        self.num_accepted += 1
        return True

    def accept_forced(self, token_id: int) -> bool:
        return self.accept_token(token_id)

    def jump_forward(self, sampled: int | None, budget: int) -> list[int]:
        """Jump-forward runs inside the answer only: the token that closes the thought is followed at once by
        the text the grammar forces from its root ('{"'), and answer tokens as ``plan_jump`` spells them."""
        if self.inner is None or self.state != ANSWER:
            return [] if sampled is None else [sampled]
        accepted = self.inner.num_accepted
        if sampled is not None and sampled == self.markers.close_id and not self._history[-1][2]:
            tokens = [sampled, *self.inner.jump_forward(None, budget - 1)]
        else:
            tokens = self.inner.jump_forward(sampled, budget)
        # plan_jump may re-spell the sampled token; every other token it returns the inner matcher took.
        for _ in range(self.inner.num_accepted - accepted):
            self._history.append((ANSWER, self.num_reasoning_tokens, True))
            self.num_accepted += 1
        return tokens

    def rollback(self, num_tokens: int = 1) -> None:
        inner_tokens = 0
        for _ in range(num_tokens):
            state, count, took = self._history.pop()
            self.state, self.num_reasoning_tokens = state, count
            inner_tokens += took
        self.num_accepted -= num_tokens
        if inner_tokens:
            self.inner.rollback(inner_tokens)

    def is_terminated(self) -> bool:
        return self.state == ANSWER and self.inner is not None and self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.state == ANSWER and self.inner is not None and self.inner.is_completed()

    # ---- masks ----------------------------------------------------------------------------------------
    def fill_allowed(
        self, bitmask: torch.Tensor, row: int = 0, allow_stop: bool = True, budget: int | None = None
    ) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (see ``StructuredMatcher.fill_allowed``)."""
        inner = self.inner
        if self.state == ANSWER:
            if inner is not None:
                inner.fill_allowed(bitmask, row, allow_stop, budget)
            else:
                bitmask[row] = -1
                self._clear(bitmask, row, self.markers.open_id)  # one thought a turn: the budget holds
            return
        if self.state == THOUGHT:
            if self._must_close(budget):
                force_token(bitmask, row, self.markers.close_id)
                return
            bitmask[row] = -1
            self._clear(bitmask, row, self.markers.open_id)  # thoughts do not nest
            if inner is not None:  # the answer must still come: no stop inside the thought
                withhold_stop_tokens(bitmask, [row], inner.stop_keep_mask)
            return
        if inner is None:  # start, nothing to constrain: the channel may open or not
            bitmask[row] = -1
            return
        inner._matcher.fill_next_token_bitmask(bitmask, row)
        forced = inner.forced_token(budget) if budget is not None else None
        if forced is not None:  # no room left for a thought
            force_token(bitmask, row, forced)
            return
        if not allow_stop:
            withhold_stop_tokens(bitmask, [row], inner.stop_keep_mask)
        self._set(bitmask, row, self.markers.open_id)

    def _must_close(self, budget: int | None) -> bool:
        if self.max_reasoning_tokens is not None and self.num_reasoning_tokens >= self.max_reasoning_tokens:
            return True
        # Close while the answer still fits in what max_tokens leaves once the marker is written.
        return (
            self.inner is not None and budget is not None and self.inner.forced_token(budget - 1) is not None
        )

    @staticmethod
    def _set(bitmask: torch.Tensor, row: int, token: int) -> None:
        word = int(bitmask[row, token >> 5]) & 0xFFFFFFFF
        bitmask[row, token >> 5] = _int32(word | (1 << (token & 31)))

    @staticmethod
    def _clear(bitmask: torch.Tensor, row: int, token: int) -> None:
        word = int(bitmask[row, token >> 5]) & 0xFFFFFFFF
        bitmask[row, token >> 5] = _int32(word & ~(1 << (token & 31)))


__all__ = [
    "THOUGHT_CLOSE_TOKEN",
    "THOUGHT_OPEN_TOKEN",
    "ThoughtGate",
    "ThoughtMarkers",
    "reasoning_token_count",
    "thought_markers",
]
