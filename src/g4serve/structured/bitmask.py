"""Batched token masks for the sampler: per-row grammar matchers -> one ``[B, V]`` bool tensor.

xgrammar fills a packed int32 bitmask on the CPU (bit ``t % 32`` of word ``t // 32`` allows token
``t``); it travels to the device at 1/8 of the bool size and is unpacked there in a few vectorised ops.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from g4serve.structured.backend import StructuredMatcher, force_token, withhold_stop_tokens

# Rows filled by xgrammar's thread pool once there are this many constrained rows.
_PARALLEL_ROWS = 8


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def byte_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """``[256, 8]`` bool: the bits of each byte value, lowest first."""
    values = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
    return ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, table: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, ceil(V/32)]`` int32 packed bitmask -> ``[B, V]`` bool (True: allowed), on its device.
    ``table`` is ``byte_table(bitmask.device)``, passed in to reuse it."""
    rows = bitmask.shape[0]
    if sys.byteorder != "little":
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        return (((bitmask.unsqueeze(-1) >> shifts) & 1) != 0).view(rows, -1)[:, :vocab_size]
    # Viewed as bytes, byte k of a row holds tokens 8k..8k+7 (little-endian words): one table lookup
    # per byte is the fastest unpacking on CPU and GPU alike.
    table = byte_table(bitmask.device) if table is None else table
    packed = bitmask.contiguous().view(torch.uint8).flatten().int()
    return table.index_select(0, packed).view(rows, -1)[:, :vocab_size]


class AllowedTokenMasks:
    """Builds the sampler's ``allowed`` tensor each step; keeps the CPU bitmask buffer between steps
    (pinned for CUDA, so the copy is asynchronous)."""

    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._buffer: torch.Tensor | None = None
        self._table = byte_table(self.device)
        self._batch_matcher = None

    def _bitmask(self, rows: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.shape[0] < rows:
            size = max(rows, 2 * self._buffer.shape[0] if self._buffer is not None else rows)
            self._buffer = torch.empty(
                size, bitmask_words(self.vocab_size), dtype=torch.int32, pin_memory=self.device.type == "cuda"
            )
        bitmask = self._buffer[:rows]
        bitmask.fill_(-1)  # unconstrained rows: everything allowed
        return bitmask

    def __call__(
        self,
        matchers: Sequence[StructuredMatcher | None],
        allow_stop: Sequence[bool] | None = None,
        budgets: Sequence[int] | None = None,
        drafts: Sequence[int | None] | None = None,
    ) -> torch.Tensor | None:
        """``[B, V]`` bool mask for rows with a matcher (other rows all True), or None if no row has one.
        ``allow_stop[i]`` False withholds stop tokens from row i while its grammar allows anything else
        (min_tokens, ignore_eos). ``budgets[i]`` is how many tokens row i may still produce (this one
        included): near the end the grammar is steered to close in time
        (``StructuredMatcher.forced_token``). ``drafts[i]`` (speculative decoding): the draft token row i
        is followed by; the next row, of the same matcher, is filled as if it were accepted
        (``_fill_draft_chains``)."""
        if all(m is None for m in matchers):
            return None
        bitmask = self._bitmask(len(matchers))
        if drafts is not None and any(d is not None for d in drafts):
            matchers = _fill_draft_chains(bitmask, matchers, allow_stop, budgets, drafts)
        rows = _fill_gated_rows(bitmask, matchers, allow_stop, budgets)
        if len(rows) >= _PARALLEL_ROWS:
            if self._batch_matcher is None:
                import xgrammar as xgr

                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(
                [matchers[i]._matcher for i in rows], bitmask, rows
            )
        else:
            for i in rows:
                matchers[i].fill_allowed(bitmask, i)
        withheld: dict[int, list[int]] = {}  # rows by stop set (one per backend)
        for i in rows:
            forced = matchers[i].forced_token(budgets[i]) if budgets is not None else None
            if forced is not None:
                force_token(bitmask, i, forced)
            elif allow_stop is not None and not allow_stop[i]:
                withheld.setdefault(id(matchers[i].stop_keep_mask), []).append(i)
        for group in withheld.values():
            withhold_stop_tokens(bitmask, group, matchers[group[0]].stop_keep_mask)
        return unpack_bitmask(bitmask.to(self.device, non_blocking=True), self.vocab_size, self._table)


def _fill_gated_rows(
    bitmask: torch.Tensor,
    matchers: Sequence[StructuredMatcher | None],
    allow_stop: Sequence[bool] | None,
    budgets: Sequence[int] | None,
) -> list[int]:
    """Fill the rows of thought gates (structured/reasoning.py) whole: free while the model thinks, their
    grammar after. Returns the rows of plain matchers, left to fill."""
    rows = []
    for i, m in enumerate(matchers):
        if isinstance(m, StructuredMatcher):
            rows.append(i)
        elif m is not None:
            stop = True if allow_stop is None else allow_stop[i]
            m.fill_allowed(bitmask, i, stop, None if budgets is None else budgets[i])
    return rows


def _fill_draft_chains(
    bitmask: torch.Tensor,
    matchers: Sequence[StructuredMatcher | None],
    allow_stop: Sequence[bool] | None,
    budgets: Sequence[int] | None,
    drafts: Sequence[int | None],
) -> list[StructuredMatcher | None]:
    """Fill the rows of requests verifying drafts: consecutive rows of one matcher, row j+1 after draft
    ``drafts[row j]``. Each row is filled in the state the drafts before it leave, then the matcher rolls
    back. Rows past a draft the grammar refuses stay unconstrained: that draft cannot be sampled, so
    verification stops at its row. So do rows past a draft that ends the grammar (a stop token after a
    complete match): the request ends there if it is accepted, and a terminated matcher has no mask to fill
    (xgrammar raises, which failed every request of the step). Returns ``matchers`` with the filled rows set
    to None."""
    rest = list(matchers)
    i = 0
    while i < len(rest):
        m = rest[i]
        if m is None or drafts[i] is None:
            i += 1
            continue
        end = i
        while end + 1 < len(rest) and rest[end + 1] is m:
            end += 1
        accepted = 0
        for row in range(i, end + 1):
            stop = True if allow_stop is None else allow_stop[row]
            m.fill_allowed(bitmask, row, stop, None if budgets is None else budgets[row])
            if row == end or drafts[row] is None or not m.accept_token(drafts[row]):
                break
            accepted += 1
            if m.is_terminated():
                break
        if accepted:
            m.rollback(accepted)
        for row in range(i, end + 1):
            rest[row] = None
        i = end + 1
    return rest


def build_allowed_mask(
    matchers: Sequence[StructuredMatcher | None],
    vocab_size: int,
    device: torch.device | str = "cpu",
    allow_stop: Sequence[bool] | None = None,
    budgets: Sequence[int] | None = None,
) -> torch.Tensor | None:
    """One-off form of ``AllowedTokenMasks``: ``[B, V]`` bool allowed tokens, or None if no row is
    constrained."""
    return AllowedTokenMasks(vocab_size, device)(matchers, allow_stop, budgets)
