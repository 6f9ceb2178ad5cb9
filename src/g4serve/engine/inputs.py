"""Step-input types shared by the model runner and the CUDA-graph runners.

``PendingTokens``: with async scheduling a request's input token may be the previous step's sample, not
yet on the host; both the eager path (``model_runner.py``) and the graph replays (``cuda_graphs.py``)
copy it into the step's token ids on the device. Kept apart from both so neither imports the other for it.

``DeviceDrafts``: an MTP round's drafts, left on the device. The step that verifies them reads them into its
input ids on the device (as ``PendingTokens``) and copies them to the host behind itself, so the host learns
the drafts with that step's samples: one wait per speculative step instead of two, and the drafting round
runs while the host schedules and prepares the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from g4serve.transfer import to_device


@dataclass
class PendingTokens:
    """Input tokens still on the device: flat row ``rows[i]`` of this step takes ``tokens[src[i]]``."""

    rows: list[int]
    src: list[int]
    tokens: torch.Tensor

    def write_into(self, ids: torch.Tensor) -> None:
        k = len(self.rows)
        if self.rows == self.src and self.rows[-1] == k - 1:  # steady decode: same requests, same order
            ids[:k].copy_(self.tokens[:k])
            return
        index = to_device([self.rows, self.src], torch.long, ids.device)
        ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]))


class DeviceDrafts:
    """One drafting round's tokens on the device, ``tokens`` [B, k] (the round's own copy, never overwritten),
    request i's drafts in row i. ``start_copy`` queues their copy to the host on the current stream;
    ``row`` reads it once the stream has passed that point (the verifying step's read-back waited)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self._host: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        if self._host is not None:
            return
        self._host = self.tokens.to("cpu", non_blocking=True)
        if self.tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def row(self, index: int, count: int) -> list[int]:
        """Request ``index``'s first ``count`` drafts (waits for the copy, normally already done)."""
        assert self._host is not None, "start_copy() comes first"
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host[index, :count].tolist()


def gather_pending(groups: list[tuple[torch.Tensor, list[int], list[int]]]) -> PendingTokens | None:
    """One ``PendingTokens`` over several device sources: ``(tokens, rows, src)`` groups, flat row ``rows[i]``
    taking ``tokens.view(-1)[src[i]]`` of its group (sources concatenated on the device when there are
    several)."""
    groups = [g for g in groups if g[1]]
    if not groups:
        return None
    if len(groups) == 1:
        tokens, rows, src = groups[0]
        return PendingTokens(rows, src, tokens.reshape(-1))
    rows, src, parts, base = [], [], [], 0
    for tokens, group_rows, group_src in groups:
        flat = tokens.reshape(-1)
        rows += group_rows
        src += [base + s for s in group_src]
        parts.append(flat.to(groups[0][0].dtype))
        base += flat.numel()
    return PendingTokens(rows, src, torch.cat(parts))
