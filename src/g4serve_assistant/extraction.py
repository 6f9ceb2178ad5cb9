"""Gemma extraction for utterances the fast path is unsure of: a stable prompt, a shallow constrained JSON
schema, temperature 0, and jsonschema validation before anything reaches the policy."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from g4serve_assistant.intents import INTENTS

log = logging.getLogger("g4serve_assistant")

MAX_CANDIDATES = 5
# Currencies the extraction may name (ISO 4217); anything else is not a currency this bank moves money in.
CURRENCIES = ("USD", "EUR", "GBP", "CAD", "AUD", "CHF", "JPY", "MXN", "INR")
MONEY_INTENTS = ("transfer_money", "bill_payment")
DEFAULT_MAX_TOKENS = 96
# Strings are bounded and ASCII-only: together with the integer bound, every valid output has a known
# maximum length, so a budget of that many tokens always lets the JSON close (tokens are >= 1 byte).
_NAME_PATTERN = "^[A-Za-z0-9 .'&-]{0,32}$"
_WORD_PATTERN = "^[a-z0-9 -]{0,16}$"
_DATE_PATTERN = "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
_REASON_PATTERN = "^[A-Za-z0-9 ,.'-]{0,48}$"
_MAX_AMOUNT_MINOR = 99_999_999_999  # 11 digits: a billion dollars is beyond any limit the policy allows

# The fixed part of the prompt: instructions, rules, the schema in words, and examples. It never changes
# between calls, and the transcript and candidates come after it, so the engine's prefix cache serves it.
EXTRACTION_SYSTEM = f"""You turn one utterance of a bank customer into a JSON object \
for the bank's voice assistant.

Rules:
- intent is one of: {", ".join(INTENTS)}.
- Amounts: amount_minor is the amount in minor units (cents): "fifty dollars" is 5000, \
"12.50 euros" is 1250. \
Use null when no amount was said. Never guess an amount.
- currency is an ISO 4217 code ({", ".join(CURRENCIES)}) or null; dollars mean USD unless said otherwise.
- recipient_candidate_id is the id (c1, c2, ...) of the listed candidate the customer means, or null when \
none matches or several match equally well. Choose only from the listed candidates.
- needs_confirmation is true for transfer_money and bill_payment, otherwise false.
- ambiguity_reason says in a few words what is unclear (two payees match, no amount, ...), or null.
- entities may hold payee_name (as said), date (YYYY-MM-DD), card (debit or credit) and account \
(checking or savings); leave out what was not said.

Output schema: {{"intent": str, \
"entities": {{"payee_name"?: str, "date"?: str, "card"?: str, "account"?: str}}, \
"amount_minor": int|null, "currency": str|null, "recipient_candidate_id": str|null, \
"needs_confirmation": bool, "ambiguity_reason": str|null}}

Example 1
Transcript: send fifty bucks to jon
Candidates:
c1: Jon Smith (friend)
c2: Joan Miller (family)
Output: {{"intent": "transfer_money", "entities": {{"payee_name": "jon"}}, "amount_minor": 5000, \
"currency": "USD", "recipient_candidate_id": "c1", "needs_confirmation": true, "ambiguity_reason": null}}

Example 2
Transcript: can you take care of the power company thing
Candidates:
c1: City Electric (biller)
Output: {{"intent": "bill_payment", "entities": {{"payee_name": "power company"}}, "amount_minor": null, \
"currency": null, "recipient_candidate_id": "c1", "needs_confirmation": true, \
"ambiguity_reason": "no amount"}}

Example 3
Transcript: um my card is like gone I think
Candidates: none
Output: {{"intent": "card_lock", "entities": {{"card": "debit"}}, "amount_minor": null, "currency": null, \
"recipient_candidate_id": null, "needs_confirmation": false, "ambiguity_reason": "card type not said"}}

Answer with the JSON object only."""


def candidate_ids(n: int) -> list[str]:
    """Ids offered to the model: positional (c1..cN), not database ids.

    Why: the schema's enum is compiled into a grammar per distinct id set (about a second for a 262k
    vocabulary); positional ids give MAX_CANDIDATES + 1 schemas, all compiled at start-up, and keep
    payee ids out of the prompt (the model never sees or echoes internal identifiers).
    """
    return [f"c{i + 1}" for i in range(n)]


@lru_cache(maxsize=MAX_CANDIDATES + 1)
def _schema_json(n_candidates: int) -> str:
    schema = {
        "type": "object",
        "properties": {
            "intent": {"type": "string", "enum": list(INTENTS)},
            "entities": {
                "type": "object",
                "properties": {
                    "payee_name": {"type": "string", "pattern": _NAME_PATTERN},
                    "date": {"type": "string", "pattern": _DATE_PATTERN},
                    "card": {"type": "string", "pattern": _WORD_PATTERN},
                    "account": {"type": "string", "pattern": _WORD_PATTERN},
                },
                "additionalProperties": False,
            },
            "amount_minor": {"type": ["integer", "null"], "minimum": 0, "maximum": _MAX_AMOUNT_MINOR},
            "currency": {"enum": [*CURRENCIES, None]},
            "recipient_candidate_id": {"enum": [*candidate_ids(n_candidates), None]},
            "needs_confirmation": {"type": "boolean"},
            "ambiguity_reason": {"anyOf": [{"type": "string", "pattern": _REASON_PATTERN}, {"type": "null"}]},
        },
        "required": [
            "intent",
            "entities",
            "amount_minor",
            "currency",
            "recipient_candidate_id",
            "needs_confirmation",
            "ambiguity_reason",
        ],
        "additionalProperties": False,
    }
    return json.dumps(schema)


def extraction_schema(n_candidates: int) -> dict:
    """The JSON schema of one extraction with ``n_candidates`` offered candidates (0..MAX_CANDIDATES)."""
    if not 0 <= n_candidates <= MAX_CANDIDATES:
        raise ValueError(f"n_candidates: must be in [0, {MAX_CANDIDATES}], got {n_candidates}")
    return json.loads(_schema_json(n_candidates))


def max_output_bytes(schema: dict) -> int:
    """Longest JSON text (bytes) the schema allows, as the grammar writes it (", " and ": " separators).

    Only the keywords ``extraction_schema`` uses are understood; anything unbounded raises ValueError.
    """
    if "anyOf" in schema:
        return max(max_output_bytes(s) for s in schema["anyOf"])
    if "enum" in schema:
        return max(len(json.dumps(v).encode()) for v in schema["enum"])
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    sizes = []
    for t in types:
        if t == "null":
            sizes.append(4)
        elif t == "boolean":
            sizes.append(5)
        elif t == "integer":
            if "maximum" not in schema or schema.get("minimum", -1) < 0:
                raise ValueError("integer without bounds")
            sizes.append(len(str(schema["maximum"])))
        elif t == "string":
            sizes.append(2 + _pattern_max_chars(schema.get("pattern")))
        elif t == "object":
            props = schema.get("properties", {})
            parts = [len(json.dumps(k)) + 2 + max_output_bytes(s) for k, s in props.items()]
            sizes.append(2 + sum(parts) + 2 * max(len(parts) - 1, 0))
        else:
            raise ValueError(f"unbounded or unsupported type {t!r}")
    return max(sizes)


def _pattern_max_chars(pattern: str | None) -> int:
    # Only this module's patterns: one ASCII class with a {m,n} count, or the fixed date.
    if pattern == _DATE_PATTERN:
        return 10
    if pattern and pattern.endswith("}$") and "," in pattern:
        return int(pattern.rsplit(",", 1)[1].rstrip("}$"))
    raise ValueError(f"unbounded string pattern {pattern!r}")


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
    finish_reason: str | None = None
    timeline: dict[str, float] = field(default_factory=dict)  # perf_counter() of request start/end

    @property
    def payee_id(self) -> str | None:
        cid = (self.output or {}).get("recipient_candidate_id")
        return self.offered[int(cid[1:]) - 1] if cid else None


class Extractor:
    """Builds the prompt, runs the constrained call on an ``AsyncLLMEngine`` and validates the output."""

    def __init__(self, engine, max_tokens: int | None = DEFAULT_MAX_TOKENS):
        import jsonschema

        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._validators = {
            n: jsonschema.Draft202012Validator(extraction_schema(n)) for n in range(MAX_CANDIDATES + 1)
        }
        bound = max_output_bytes(extraction_schema(MAX_CANDIDATES))
        self.max_tokens = self._budget(max_tokens, bound)
        self._specs: dict[int, Any] = {}
        marker = "\x00TRANSCRIPT\x00"
        rendered = self.tokenizer.apply_chat_template(self._messages_for(marker), add_generation_prompt=True)
        self.fixed_prefix = rendered[: rendered.index(marker)]
        self.fixed_prefix_ids = self.tokenizer.encode(self.fixed_prefix, add_special_tokens=False)

    def _budget(self, requested: int | None, bound_bytes: int) -> int:
        """``requested`` tokens unless this tokenizer cannot write the longest valid output in that many.

        Gemma's 262k vocabulary writes it in ~60 tokens, so the 96-token cap holds; a small test tokenizer
        (the tiny model's 1k BPE) needs several times that, and a truncated JSON would never parse.
        """
        if requested is None:
            return bound_bytes
        longest = {
            "intent": max(INTENTS, key=len),
            "entities": {
                "payee_name": "Alexandra Montgomery-Smith Jr.",
                "date": "2025-12-31",
                "card": "debit",
                "account": "checking",
            },
            "amount_minor": _MAX_AMOUNT_MINOR,
            "currency": "USD",
            "recipient_candidate_id": "c5",
            "needs_confirmation": True,
            "ambiguity_reason": "two payees match the name and no amount was said",
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
    def user_text(transcript: str, candidates: Sequence, normalized: str | None = None) -> str:
        """The per-call tail: transcript (and its normalized form), then the offered candidates."""
        lines = [f"Transcript: {transcript.strip()}"]
        if normalized and normalized.strip() != transcript.strip():
            lines.append(f"Normalized: {normalized.strip()}")
        if candidates:
            lines.append("Candidates:")
            for cid, cand in zip(candidate_ids(len(candidates)), candidates, strict=True):
                lines.append(f"{cid}: {cand.display_name} ({cand.relationship or cand.kind})")
        else:
            lines.append("Candidates: none")
        return "\n".join(lines)

    def prompt(self, transcript: str, candidates: Sequence, normalized: str | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            self._messages_for(self.user_text(transcript, candidates, normalized)), add_generation_prompt=True
        )

    def spec(self, n_candidates: int):
        from g4serve.structured import StructuredSpec

        if n_candidates not in self._specs:
            self._specs[n_candidates] = StructuredSpec.json_schema(extraction_schema(n_candidates))
        return self._specs[n_candidates]

    def params(self, n_candidates: int):
        from g4serve.sampling_params import SamplingParams

        return SamplingParams(
            temperature=0.0, max_tokens=self.max_tokens, structured_output=self.spec(n_candidates)
        )

    async def warmup(self) -> None:
        """Compile the grammar of every candidate count now (off the event loop), not on a user's turn, and
        prefill the fixed prompt once so the first user's call finds it in the prefix cache."""
        from g4serve.sampling_params import SamplingParams

        processed = await self.engine.process(self.prompt("warm up", []), add_special_tokens=False)
        for n in range(MAX_CANDIDATES + 1):  # admitted only to compile the grammar: never queued
            await self.engine.validate(processed, self.params(n))
        async for _ in self.engine.generate(processed, SamplingParams(temperature=0.0, max_tokens=1)):
            pass

    # ---- call -------------------------------------------------------------------------------------------
    async def extract(
        self, transcript: str, candidates: Sequence, normalized: str | None = None
    ) -> Extraction:
        candidates = list(candidates)[:MAX_CANDIDATES]
        offered = [c.payee_id for c in candidates]
        processed = await self.engine.process(
            self.prompt(transcript, candidates, normalized), add_special_tokens=False
        )
        t_start = time.perf_counter()
        pieces: list[str] = []
        out_tokens = cached = 0
        finish_reason = None
        async for delta in self.engine.generate(processed, self.params(len(candidates))):
            pieces.append(delta.text)
            out_tokens, cached = delta.num_output_tokens, delta.num_cached_tokens
            if delta.finished:
                finish_reason = delta.finish_reason
        t_end = time.perf_counter()
        raw = "".join(pieces)
        output, error = self.validate(raw, len(candidates))
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
            finish_reason=finish_reason,
            timeline={"llm_start": t_start, "llm_end": t_end},
        )

    def validate(self, raw: str, n_candidates: int) -> tuple[dict | None, str | None]:
        """Parse and check against the schema; the grammar should make this always pass, but the policy
        acts on money, so nothing is trusted unchecked (a truncated output, a grammar bug)."""
        try:
            output = json.loads(raw)
        except json.JSONDecodeError as exc:
            return None, f"not JSON: {exc}"
        errors = sorted(self._validators[n_candidates].iter_errors(output), key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path) or "(root)"
            return None, f"{where}: {errors[0].message}"
        return output, None


def merge_into_result(
    base,
    extraction: Extraction,
    candidates: Sequence,
    heard_amounts: Sequence[tuple[int, str]] = (),
    confidence: float = 0.9,
):
    """The fast path's ``IntentResult`` updated with a valid extraction; the policy re-validates it.

    The model fills gaps, it does not overrule the rules: its amount is used only when it is one of the
    amounts the normalizer heard (``heard_amounts``, (amount_minor, currency) pairs: the model chose which
    one), never a number only the model read. Without one the policy asks "how much?". ``confidence`` is a
    fixed, uncalibrated value.
    """
    out = extraction.output or {}
    entities = dict(base.entities or {})
    for key, value in (out.get("entities") or {}).items():
        entities.setdefault(key, value)
    amount = out.get("amount_minor")
    heard = [(a, c) for a, c in heard_amounts if a == amount and out.get("currency") in (None, c)]
    if amount is not None and heard:
        entities["amount_minor"], entities["currency"] = heard[0]
    payee_id = extraction.payee_id
    if payee_id is not None:
        chosen = next(c for c in candidates if c.payee_id == payee_id)
        entities["payee_id"] = payee_id
        entities["payee_name"] = chosen.display_name
    elif candidates:
        entities.pop("payee_id", None)  # offered candidates and the model chose none: no guess survives
    return dataclasses.replace(
        base,
        intent=out["intent"],
        confidence=confidence,
        entities=entities,
        needs_llm=False,
        ambiguity_reason=out.get("ambiguity_reason"),
        rules=[*(base.rules or []), "gemma_extraction"],
    )
