"""Speculative decoding: a proposer drafts up to k tokens per decoding request, the next target step computes
the last token and the drafts together, and verification keeps the longest prefix of drafts the target agrees
with plus one token of its own.

Drafts are deterministic (n-gram lookup, or the MTP drafter's argmax), so verification is exact rejection
sampling by construction: every verified row is sampled from the target's own distribution (temperature,
top-p, top-k, min-p, logit bias), draft i is accepted iff row i's sample equals it, which happens with
probability p(draft), and the first row whose sample differs supplies that sample, which is then distributed
as p without the draft, renormalized. Greedy outputs are identical to decoding without speculation, and
sampled outputs keep the target's distribution. A grammar's mask of row i is the one its state after drafts
1..i-1 gives (``AllowedTokenMasks``' draft chains), so constrained requests speculate too; drafts are cut at
the first token their grammar refuses. Requests whose next distribution would depend on the drafts otherwise
(penalties, min_tokens not reached, jump-forward) get no drafts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from g4serve.engine.inputs import DeviceDrafts
from g4serve.layers.attention import AttentionBackend, contiguous_metadata
from g4serve.transfer import to_device

if TYPE_CHECKING:
    from g4serve.engine.cuda_graphs import DraftGraphRunner
    from g4serve.engine.request import Request
    from g4serve.models.gemma4.assistant import Gemma4Assistant
    from g4serve.models.gemma4.model import Gemma4Model

METHODS = ("ngram", "mtp")


@dataclass
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` keys: ``method`` (``ngram`` or ``mtp``), ``num_speculative_tokens``,
    ``model`` (the MTP drafter checkpoint; ``"random"``: a drafter of benchmark shape with random weights),
    ``prompt_lookup_max`` / ``prompt_lookup_min`` (n-gram sizes).

    ``forced_acceptance`` (benchmarks only: outputs are no longer the target's): each draft is taken as
    accepted with this probability, whatever the target says, until the first one that is not, and the
    round appends the target's samples of those rows. 1.0 measures the ceiling of speculation (every draft
    accepted, as if the drafter copied the target's argmax), 0.7 a drafter agreeing 70% of the time; random
    weights give no real acceptance to measure speed with."""

    method: str
    num_speculative_tokens: int = 3
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    forced_acceptance: float | None = None

    @classmethod
    def parse(cls, raw: dict | str) -> SpeculativeConfig:
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config: expected a JSON object")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key")
        config = cls(**raw)
        config.check()
        return config

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: expected one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative_config.{name}: must be an integer, got {value!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens: must be an integer in [1, 16]")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError("speculative_config.model: must be a directory path (a string)")
        if self.method == "mtp" and not self.model:
            raise ValueError("speculative_config.model: the MTP drafter's checkpoint directory is required")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError("speculative_config.prompt_lookup_min/max: need 1 <= min <= max <= 64")
        rate = self.forced_acceptance
        if rate is not None and (
            not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0.0 <= rate <= 1.0
        ):
            raise ValueError(
                f"speculative_config.forced_acceptance: must be a number in [0, 1], got {rate!r}"
            )


def can_speculate(request: Request) -> bool:
    """Whether the request's next distributions do not depend on the drafts beyond what verification
    accounts for (see the module docstring)."""
    params = request.sampling_params
    return (
        not request.jump_forward
        and not params.has_penalties
        and not request.min_tokens_pending
        and not request.finished
    )


@dataclass
class SpecStats:
    """Drafted and accepted tokens per draft position (index 0: the first draft of a round)."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        while len(self.drafted) < num_drafts:
            self.drafted.append(0)
            self.accepted.append(0)
        for i in range(num_drafts):
            self.drafted[i] += 1
            self.accepted[i] += i < num_accepted


def verify(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified round appends: the drafts while each equals the target's sample of its row,
    then the sample of the first row that disagrees (or of the row after the last draft)."""
    assert len(sampled) == len(drafts) + 1
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return drafts[:n] + [sampled[n]]


def grammar_prefix(grammar, drafts: list[int]) -> list[int]:
    """The drafts up to the first one ``grammar`` refuses (its state is left as it was)."""
    n = 0
    while n < len(drafts) and grammar.accept_token(drafts[n]):
        n += 1
    if n:
        grammar.rollback(n)
    return drafts[:n]


def forced_verify(num_drafts: int, sampled: list[int], rate: float, rng: np.random.Generator) -> list[int]:
    """``verify`` under ``forced_acceptance``: each draft is accepted with probability ``rate`` until the
    first that is not; the round appends the target's samples of the accepted rows and of the next one."""
    n = 0
    while n < num_drafts and rng.random() < rate:
        n += 1
    return sampled[: n + 1]


class NgramProposer:
    """Prompt-lookup decoding: the tokens that followed the latest earlier occurrence of the sequence's last
    n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)."""

    needs_hidden = False

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, requests: list[Request], budgets: list[int], **_) -> list[list[int]]:
        return [self._lookup(r.prompt_token_ids + r.output_token_ids, b) for r, b in zip(requests, budgets)]

    def _lookup(self, tokens: list[int], budget: int) -> list[int]:
        k = min(self.k, budget)
        if k <= 0:
            return []
        seq = np.asarray(tokens)
        length = len(seq)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # every earlier occurrence of the last n tokens, at once (the history grows with each step)
            hits = np.flatnonzero((sliding_window_view(seq[:-1], n) == seq[-n:]).all(axis=1))
            if hits.size:
                # The latest occurrence with k tokens after it; in a loop the latest one sits right before
                # the end, so without a full continuation the earliest (longest) one wins.
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[0])
                return tokens[start + n : start + n + k]
        return []


class MTPProposer:
    """Gemma 4's MTP drafter: k argmax steps from the target's last hidden state, over the target's cache.
    ``graphs``: the rounds replayed as CUDA graphs (``DraftGraphRunner``) for batches they hold."""

    needs_hidden = True

    def __init__(
        self,
        config: SpeculativeConfig,
        drafter: Gemma4Assistant,
        target: Gemma4Model,
        graphs: DraftGraphRunner | None = None,
        decodable_vocab_size: int | None = None,
    ):
        self.k = config.num_speculative_tokens
        self.drafter = drafter
        self.target = target
        self.graphs = graphs
        self.decodable_vocab_size = decodable_vocab_size
        self.num_graph_rounds = 0

    @torch.inference_mode()
    def propose(
        self,
        requests: list[Request],
        budgets: list[int],
        hidden: torch.Tensor,
        tables: list[dict[str, list[int]]],
        backend: AttentionBackend,
        block_size: int,
        on_device: bool = False,
    ) -> list[list[int]] | DeviceDrafts:
        """``hidden`` [len(requests), H]: the target's final hidden state of the row that sampled each
        request's last token; ``tables``: each request's block tables. Every request has computed all tokens
        but its last (verification rolled back to that). ``on_device``: return the round's drafts [B, k]
        without waiting for them (the caller cuts each request's to its budget), else token lists cut to
        ``budgets``."""
        if min(self.k, max(budgets, default=0)) <= 0:
            return [[] for _ in requests]
        computed = [r.num_computed_tokens for r in requests]
        last = [r.output_token_ids[-1] for r in requests]
        by_pool = {pool: [t[pool] for t in tables] for pool in tables[0]}
        if self.graphs is not None and len(requests) <= self.graphs.max_batch:
            self.num_graph_rounds += 1
            # the graph's output buffer is the next round's too: a round left on the device gets its own copy
            drafts = self.graphs.draft(last, computed, by_pool, hidden)
            drafts = drafts.clone() if on_device else drafts
        else:
            device = hidden.device
            meta = contiguous_metadata(
                [c - 1 for c in computed],  # the query sits where a decode of the last computed token would
                [1] * len(requests),
                by_pool,
                block_size,
                device,
                [[] for _ in requests],
            )
            drafts = self.drafter.draft(
                self.target.language_model.embed,
                to_device(last, torch.long, device),
                hidden,
                to_device(computed, torch.long, device),
                meta,
                backend,
                self.k,
                self.decodable_vocab_size,
            )
        if on_device:
            return DeviceDrafts(drafts)
        return [row[:b] for row, b in zip(drafts.tolist(), budgets)]


__all__ = [
    "METHODS",
    "MTPProposer",
    "NgramProposer",
    "SpecStats",
    "SpeculativeConfig",
    "can_speculate",
    "forced_verify",
    "grammar_prefix",
    "verify",
]
