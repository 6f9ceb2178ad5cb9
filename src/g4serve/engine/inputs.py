"""Step-input types shared by the model runner and the CUDA-graph runners.

``PendingTokens``: with async scheduling a request's input token may be the previous step's sample, not
yet on the host; both the eager path (``model_runner.py``) and the graph replays (``cuda_graphs.py``)
copy it into the step's token ids on the device. Kept apart from both so neither imports the other for it.
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
