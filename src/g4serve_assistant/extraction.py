"""Gemma extraction for utterances the fast path is unsure of: a stable prompt, a compact constrained JSON
schema (the model chooses the intent, a candidate and which heard amount's words the request is for;
everything else is deterministic),
temperature 0, and jsonschema validation before anything reaches the policy."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from g4serve_assistant.intents import AMBIGUOUS_PAYEE, INTENTS
from g4serve_assistant.normalize import Money, normalize

log = logging.getLogger("g4serve_assistant")

MAX_CANDIDATES = 5
MAX_AMOUNTS = 3  # amounts the normalizer heard that the model may choose among ("fifty ... no, sixty")
DEFAULT_MAX_TOKENS = 96

# The fixed part of the prompt: instructions, the schema in words, and examples. It never changes between
# calls, and the transcript, candidates and amounts come after it, so the engine's prefix cache serves it.
EXTRACTION_SYSTEM = f"""You read one utterance of a bank customer for the bank's voice assistant and \
answer with a JSON object of three fields.

- intent: one of {", ".join(INTENTS)}.
- candidate: the id (c1, c2, ...) of the listed candidate the customer means, or null when none matches \
or several match equally well. Choose only from the listed candidates.
- amount: the id (a1, a2, ...) of the listed amount, as heard in the customer's words, that the request is \
for, or null when none is. Never make up an amount: when no amount is listed, it is null.

Example 1
Transcript: send fifty bucks to jon
Candidates:
c1: Jon Smith (friend)
c2: Joan Miller (family)
Amounts:
a1: fifty bucks
Output: {{"intent": "transfer_money", "candidate": "c1", "amount": "a1"}}

Example 2
Transcript: can you take care of the power company thing
Candidates:
c1: City Electric (biller)
Amounts: none
Output: {{"intent": "bill_payment", "candidate": "c1", "amount": null}}

Example 3
Transcript: um my card is like gone I think
Candidates: none
Amounts: none
Output: {{"intent": "card_lock", "candidate": null, "amount": null}}

Answer with the JSON object only."""


def candidate_ids(n: int) -> list[str]:
    """Ids offered to the model: positional (c1..cN), not database ids.

    Why: the schema's enum is compiled into a grammar per distinct id set (about a second for a 262k
    vocabulary); positional ids give (MAX_CANDIDATES + 1) x (MAX_AMOUNTS + 1) schemas, all compiled at
    start-up, and keep payee ids out of the prompt (the model never sees or echoes internal identifiers).
    """
    return [f"c{i + 1}" for i in range(n)]


def amount_ids(n: int) -> list[str]:
    """Ids of the heard amounts offered to the model (a1..aN), each listed with the words it was heard in.

    The model chooses which of the customer's amount words the request is for; it never writes a number.
    A choice is two tokens at most (jump-forward writes the rest), where free-form amount words cost one
    decoded token a word, and only an amount the normalizer heard can be chosen at all.
    """
    return [f"a{i + 1}" for i in range(n)]


@lru_cache(maxsize=(MAX_CANDIDATES + 1) * (MAX_AMOUNTS + 1))
def _schema_json(n_candidates: int, n_amounts: int) -> str:
    schema = {
        "type": "object",
        "properties": {
            "intent": {"type": "string", "enum": list(INTENTS)},
            "candidate": {"enum": [*candidate_ids(n_candidates), None]},
            "amount": {"enum": [*amount_ids(n_amounts), None]},
        },
        "required": ["intent", "candidate", "amount"],
        "additionalProperties": False,
    }
    return json.dumps(schema)


def extraction_schema(n_candidates: int, n_amounts: int = 0) -> dict:
    """The JSON schema of one extraction with ``n_candidates`` offered candidates (0..MAX_CANDIDATES) and
    ``n_amounts`` heard amounts (0..MAX_AMOUNTS)."""
    if not 0 <= n_candidates <= MAX_CANDIDATES:
        raise ValueError(f"n_candidates: must be in [0, {MAX_CANDIDATES}], got {n_candidates}")
    if not 0 <= n_amounts <= MAX_AMOUNTS:
        raise ValueError(f"n_amounts: must be in [0, {MAX_AMOUNTS}], got {n_amounts}")
    return json.loads(_schema_json(n_candidates, n_amounts))


def max_output_bytes(schema: dict) -> int:
    """Longest JSON text (bytes) the schema allows, as the grammar writes it (", " and ": " separators).

    Only the keywords ``extraction_schema`` uses are understood; anything unbounded raises ValueError.
    """
    if "anyOf" in schema:
        return max(max_output_bytes(s) for s in schema["anyOf"])
    if "enum" in schema:
        return max(len(json.dumps(v).encode()) for v in schema["enum"])
    sizes = []
    for t in schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]:
        if t == "null":
            sizes.append(4)
        elif t == "object":
            props = schema.get("properties", {})
            parts = [len(json.dumps(k)) + 2 + max_output_bytes(s) for k, s in props.items()]
            sizes.append(2 + sum(parts) + 2 * max(len(parts) - 1, 0))
        else:
            raise ValueError(f"unbounded or unsupported type {t!r}")
    return max(sizes)


def heard_amounts(text: str, default_currency: str = "USD") -> list[Money]:
    """The amounts the normalizer hears in ``text`` (each with the words it was heard in), as the pipeline
    gets them."""
    return list(normalize(text, default_currency=default_currency).amounts)


def _listing(title: str, entries: list[str]) -> list[str]:
    """A titled list of the prompt's tail ("Candidates:" and one line each), or "<title>: none"."""
    return [f"{title}:", *entries] if entries else [f"{title}: none"]


@dataclass
class Extraction:
    """One extraction call: what the model said, whether it validated, and how long it took."""

    output: dict | None
    raw: str
    valid: bool
    error: str | None
    offered: list[str]  # payee ids behind c1..cN, in order
    llm_ms: float = 0.0
    validation_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    decoded_tokens: int = 0  # of output_tokens, those the model sampled (one forward each)
    forced_tokens: int = 0  # of output_tokens, those the grammar forced (jump-forward; no forward)
    finish_reason: str | None = None
    amounts: list[tuple[int, str]] = field(default_factory=list)  # (amount_minor, currency) behind a1..aN
    timeline: dict[str, float] = field(default_factory=dict)  # perf_counter() of request start/end

    @property
    def payee_id(self) -> str | None:
        cid = (self.output or {}).get("candidate")
        return self.offered[int(cid[1:]) - 1] if cid else None

    @property
    def amount(self) -> tuple[int, str] | None:
        """The heard amount the model chose, as (amount_minor, currency)."""
        aid = (self.output or {}).get("amount")
        return self.amounts[int(aid[1:]) - 1] if aid else None


class Extractor:
    """Builds the prompt, runs the constrained call on an ``AsyncLLMEngine`` and validates the output."""

    def __init__(self, engine, max_tokens: int | None = DEFAULT_MAX_TOKENS):
        import jsonschema

        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._validators = {
            (n, k): jsonschema.Draft202012Validator(extraction_schema(n, k))
            for n in range(MAX_CANDIDATES + 1)
            for k in range(MAX_AMOUNTS + 1)
        }
        bound = max_output_bytes(extraction_schema(MAX_CANDIDATES, MAX_AMOUNTS))
        self.max_tokens = self._budget(max_tokens, bound)
        self._specs: dict[tuple[int, int], Any] = {}
        marker = "\x00TRANSCRIPT\x00"
        rendered = self.tokenizer.apply_chat_template(self._messages_for(marker), add_generation_prompt=True)
        self.fixed_prefix = rendered[: rendered.index(marker)]
        self.fixed_prefix_ids = self.tokenizer.encode(self.fixed_prefix, add_special_tokens=False)

    def _budget(self, requested: int | None, bound_bytes: int) -> int:
        """``requested`` tokens unless this tokenizer cannot write the longest valid output in that many.

        Gemma's 262k vocabulary writes it in a few dozen tokens, so the 96-token cap holds; a small test
        tokenizer (the tiny model's 1k BPE) needs more, and a truncated JSON would never parse.
        """
        if requested is None:
            return bound_bytes
        longest = {
            "intent": max(INTENTS, key=len),
            "candidate": candidate_ids(MAX_CANDIDATES)[-1],
            "amount": amount_ids(MAX_AMOUNTS)[-1],
        }
        n = len(self.tokenizer.encode(json.dumps(longest), add_special_tokens=False))
        if n <= requested:
            return requested
        log.warning(
            "extraction: this tokenizer needs %d tokens for the longest output; max_tokens raised from %d "
            "to the schema's byte bound %d",
            n,
            requested,
            bound_bytes,
        )
        return bound_bytes

    # ---- prompt ---------------------------------------------------------------------------------------
    @staticmethod
    def _messages_for(user_text: str) -> list[dict]:
        return [{"role": "system", "content": EXTRACTION_SYSTEM}, {"role": "user", "content": user_text}]

    @staticmethod
    def user_text(
        transcript: str, candidates: Sequence, normalized: str | None = None, amounts: Sequence[Money] = ()
    ) -> str:
        """The per-call tail: transcript (and its normalized form), the offered candidates, then the heard
        amounts in the words they were heard in."""
        lines = [f"Transcript: {transcript.strip()}"]
        if normalized and normalized.strip() != transcript.strip():
            lines.append(f"Normalized: {normalized.strip()}")
        lines += _listing(
            "Candidates",
            [
                f"{cid}: {cand.display_name} ({cand.relationship or cand.kind})"
                for cid, cand in zip(candidate_ids(len(candidates)), candidates, strict=True)
            ],
        )
        lines += _listing(
            "Amounts",
            [f"{aid}: {m.text.strip()}" for aid, m in zip(amount_ids(len(amounts)), amounts, strict=True)],
        )
        return "\n".join(lines)

    def prompt(
        self, transcript: str, candidates: Sequence, normalized: str | None = None, amounts: Sequence = ()
    ) -> str:
        # The per-call part is data (the customer's words, the bank's names): none of it may spell a token.
        user_text = self.tokenizer.as_text(self.user_text(transcript, candidates, normalized, amounts))
        return self.tokenizer.apply_chat_template(self._messages_for(user_text), add_generation_prompt=True)

    def spec(self, n_candidates: int, n_amounts: int = 0):
        from g4serve.structured import StructuredSpec

        key = (n_candidates, n_amounts)
        if key not in self._specs:
            self._specs[key] = StructuredSpec.json_schema(extraction_schema(*key))
        return self._specs[key]

    def params(self, n_candidates: int, n_amounts: int = 0):
        from g4serve.sampling_params import SamplingParams

        return SamplingParams(
            temperature=0.0,
            max_tokens=self.max_tokens,
            structured_output=self.spec(n_candidates, n_amounts),
        )

    async def warmup(self) -> None:
        """Compile the grammar of every candidate and amount count now (off the event loop), not on a user's
        turn, and prefill the fixed prompt once so the first user's call finds it in the prefix cache."""
        from g4serve.sampling_params import SamplingParams

        processed = await self.engine.process(self.prompt("warm up", []), add_special_tokens=False)
        for n in range(MAX_CANDIDATES + 1):  # admitted only to compile the grammar: never queued
            for k in range(MAX_AMOUNTS + 1):
                await self.engine.validate(processed, self.params(n, k))
        async for _ in self.engine.generate(processed, SamplingParams(temperature=0.0, max_tokens=1)):
            pass

    # ---- call -------------------------------------------------------------------------------------------
    async def extract(
        self,
        transcript: str,
        candidates: Sequence,
        normalized: str | None = None,
        heard: Sequence[Money] | None = None,
    ) -> Extraction:
        """One constrained call. ``heard``: the amounts the normalizer heard (the pipeline's, in the
        customer's currency; computed here when not given), of which the model may choose one."""
        candidates = list(candidates)[:MAX_CANDIDATES]
        offered = [c.payee_id for c in candidates]
        amounts = list(heard_amounts(transcript) if heard is None else heard)[:MAX_AMOUNTS]
        processed = await self.engine.process(
            self.prompt(transcript, candidates, normalized, amounts), add_special_tokens=False
        )
        t_start = time.perf_counter()
        pieces: list[str] = []
        out_tokens = cached = forced = 0
        finish_reason = None
        async for delta in self.engine.generate(processed, self.params(len(candidates), len(amounts))):
            pieces.append(delta.text)
            out_tokens, cached = delta.num_output_tokens, delta.num_cached_tokens
            forced = delta.num_forced_tokens
            if delta.finished:
                finish_reason = delta.finish_reason
        t_end = time.perf_counter()
        raw = "".join(pieces)
        output, error = self.validate(raw, len(candidates), len(amounts))
        t_valid = time.perf_counter()
        return Extraction(
            output=output,
            raw=raw,
            valid=error is None,
            error=error,
            offered=offered,
            llm_ms=(t_end - t_start) * 1000,
            validation_ms=(t_valid - t_end) * 1000,
            prompt_tokens=len(processed.token_ids),
            cached_tokens=cached,
            output_tokens=out_tokens,
            decoded_tokens=out_tokens - forced,
            forced_tokens=forced,
            finish_reason=finish_reason,
            amounts=[(m.amount_minor, m.currency) for m in amounts],
            timeline={"llm_start": t_start, "llm_end": t_end},
        )

    def validate(self, raw: str, n_candidates: int, n_amounts: int = 0) -> tuple[dict | None, str | None]:
        """Parse and check against the schema; the grammar should make this always pass, but the policy
        acts on money, so nothing is trusted unchecked (a truncated output, a grammar bug)."""
        try:
            output = json.loads(raw)
        except json.JSONDecodeError as exc:
            return None, f"not JSON: {exc}"
        validator = self._validators[(n_candidates, n_amounts)]
        errors = sorted(validator.iter_errors(output), key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path) or "(root)"
            return None, f"{where}: {errors[0].message}"
        return output, None


def merge_into_result(base, extraction: Extraction, candidates: Sequence, confidence: float = 0.9):
    """The fast path's ``IntentResult`` updated with a valid extraction; the policy re-validates it.

    The model chooses, it does not supply values: its intent, its candidate and its choice among the heard
    amounts are taken; currency, minor units, dates, cards and accounts stay the normalizer's and the
    rules'. Without an amount the policy asks "how much?". ``confidence`` is a fixed, uncalibrated value.
    """
    out = extraction.output or {}
    entities = dict(base.entities or {})
    if extraction.amount is not None:
        entities["amount_minor"], entities["currency"] = extraction.amount
    payee_id = extraction.payee_id
    reason = None
    if payee_id is not None:
        chosen = next(c for c in candidates if c.payee_id == payee_id)
        entities["payee_id"] = payee_id
        entities["payee_name"] = chosen.display_name
    elif candidates:
        entities.pop("payee_id", None)  # offered candidates and the model chose none: no guess survives
        reason = f"{AMBIGUOUS_PAYEE}: the model chose none of the candidates"
    return dataclasses.replace(
        base,
        intent=out["intent"],
        confidence=confidence,
        entities=entities,
        needs_llm=False,
        ambiguity_reason=reason,
        rules=[*(base.rules or []), "gemma_extraction"],
    )


__all__ = [
    "EXTRACTION_SYSTEM",
    "MAX_AMOUNTS",
    "MAX_CANDIDATES",
    "Extraction",
    "Extractor",
    "amount_ids",
    "candidate_ids",
    "extraction_schema",
    "heard_amounts",
    "max_output_bytes",
    "merge_into_result",
]
