"""Fast intent path (no LLM): weighted regex patterns over the normalized transcript, entities from the
normalizer and the payee index, and a confidence with the reason when the LLM should look instead."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from g4serve_assistant.normalize import Normalized
from g4serve_assistant.payees import Candidate, PayeeIndex

INTENTS: tuple[str, ...] = (
    "balance_inquiry",
    "recent_transactions",
    "transfer_money",
    "card_lock",
    "card_unlock",
    "bill_payment",
    "recipient_lookup",
    "human_handoff",
    "qna",
    "unknown",
)
MONEY_INTENTS = ("transfer_money", "bill_payment")
ACTION_INTENTS = (*MONEY_INTENTS, "card_lock", "card_unlock")

# Payee resolution: a candidate is taken when it scores ACCEPT_SCORE or more and leads the next one by
# more than PAYEE_MARGIN points (or is the only exact match); otherwise the payee is ambiguous.
ACCEPT_SCORE = 80.0
PAYEE_MARGIN = 8.0
CONFLICT_SCORE = 0.7  # two different intents both this strong: the utterance asks for two things
MIN_INTENT_SCORE = 0.5  # below this nothing matched: intent "unknown"

# Reason codes of IntentResult.ambiguity_reason ("code" or "code: detail", several joined by "; ").
LOW_CONFIDENCE = "low_confidence"
CONFLICTING_INTENTS = "conflicting_intents"
MISSING_AMOUNT = "missing_amount"
MISSING_PAYEE = "missing_payee"
AMBIGUOUS_PAYEE = "ambiguous_payee"
PAYEE_NOT_FOUND = "payee_not_found"
MULTIPLE_AMOUNTS = "multiple_amounts"
NO_INTENT = "no_intent"


def _rx(pattern: str) -> re.Pattern:
    return re.compile(pattern)


# intent -> [(rule, weight, pattern)]. Weights combine as a noisy-or: independent evidence adds up but a
# score never reaches 1. The text is normalized: lowercase, no apostrophes ("whats"), amounts "50.00 usd".
_PATTERNS: dict[str, list[tuple[str, float, re.Pattern]]] = {
    "balance_inquiry": [
        ("balance", 0.9, _rx(r"\bbalances?\b")),
        (
            "how_much_have",
            0.85,
            _rx(
                r"\bhow much (?:money )?(?:do i have|have i got|is (?:there |left )?(?:in|on)|"
                r"is left|i have|i got)\b"
            ),
        ),
        ("available_funds", 0.85, _rx(r"\bavailable (?:funds|balance|credit)\b|\bfunds available\b")),
        ("whats_in_account", 0.7, _rx(r"\b(?:whats|what is) in my (?:\w+ )?(?:checking|savings|account)\b")),
        ("overdrawn", 0.8, _rx(r"\b(?:am i|is my account) overdrawn\b")),
    ],
    "recent_transactions": [
        (
            "recent_items",
            0.9,
            _rx(
                r"\b(?:recent|last|latest|past|previous) (?:\d+ )?(?:\w+ )?(?:transactions?|purchases|"
                r"charges|activity|transfers|deposits|payments)\b"
            ),
        ),
        (
            "history",
            0.9,
            _rx(r"\b(?:transaction|account|payment|spending) history\b|\bstatement\b|\baccount activity\b"),
        ),
        (
            "show_items",
            0.85,
            _rx(
                r"\b(?:show|list|see|read|tell|give)(?: me)?(?: my| the)? (?:\w+ )?"
                r"(?:transactions|purchases|charges|activity)\b"
            ),
        ),
        (
            "what_did_i_spend",
            0.8,
            _rx(
                r"\bwhat did i (?:spend|buy)\b|\bwhere did i spend\b|\bhow much did i spend\b|"
                r"\bmy spending\b"
            ),
        ),
        ("did_i_pay", 0.75, _rx(r"\b(?:did i|when did i) (?:last |already )?pay\b")),
        ("transactions_word", 0.6, _rx(r"\btransactions?\b")),
    ],
    "transfer_money": [
        (
            "send_verb",
            0.75,
            _rx(r"\b(?:send|sending|transfer|transferring|wire|zelle|venmo|reimburse|remit)\b"),
        ),
        ("give_verb", 0.6, _rx(r"\b(?:give|move|pay back|owe)\b")),
        ("pay_verb", 0.5, _rx(r"\bpay(?:ing)?\b")),
        ("money_to", 0.6, _rx(r"\b(?:money|cash|funds)\b.* to\b")),
    ],
    "bill_payment": [
        (
            "pay_bill",
            0.9,
            _rx(
                r"\bpay(?:ing)? (?:off )?(?:my |the |this |our )?(?:\w+ ){0,2}(?:bills?|invoice|rent|"
                r"mortgage|subscription)\b"
            ),
        ),
        ("bill_word", 0.6, _rx(r"\b(?:bills?|invoice)\b")),
        ("pay_verb", 0.5, _rx(r"\bpay(?:ing)?\b")),
    ],
    "card_lock": [
        (
            "lock_card",
            0.9,
            _rx(
                r"\b(?:lock|freeze|block|disable|suspend|deactivate|cancel|turn off)\b(?: \w+){0,3} cards?\b"
            ),
        ),
        (
            "lost_stolen",
            0.9,
            _rx(
                r"\b(?:lost|stolen|stole|missing|misplaced|cant find)\b(?: \w+){0,4} "
                r"(?:cards?|wallet|purse)\b|"
                r"\b(?:cards?|wallet|purse) (?:is |was |has been |got )?(?:lost|stolen|missing)\b"
            ),
        ),
        ("lock_word", 0.6, _rx(r"\b(?:lock|freeze|block)\b")),
        ("fraud", 0.5, _rx(r"\b(?:fraud|fraudulent|unauthorized|didnt make)\b")),
    ],
    "card_unlock": [
        (
            "unlock_card",
            0.9,
            _rx(
                r"\b(?:unlock|unfreeze|unblock|reactivate|re enable|reenable|enable|turn on|activate)\b"
                r"(?: \w+){0,3} cards?\b"
            ),
        ),
        ("found_card", 0.85, _rx(r"\bfound (?:my |the )?(?:\w+ )?(?:card|wallet)\b")),
        ("unlock_word", 0.6, _rx(r"\b(?:unlock|unfreeze|unblock)\b")),
    ],
    "recipient_lookup": [
        ("is_payee", 0.9, _rx(r"\b(?:is|are|do i have|have i got)\b.*\b(?:payees?|recipients?|contacts?)\b")),
        (
            "list_payees",
            0.9,
            _rx(
                r"\b(?:list|show|who are|read|tell)(?: me)?(?: all)?(?: of)?(?: my| the)? (?:saved )?"
                r"(?:payees|recipients|contacts)\b"
            ),
        ),
        ("find_payee", 0.75, _rx(r"\b(?:find|look up|lookup|search for)\b")),
        ("who_is", 0.6, _rx(r"\bwho is\b")),
        ("payee_word", 0.6, _rx(r"\b(?:payees?|recipients?)\b")),
    ],
    "human_handoff": [
        (
            "agent",
            0.95,
            _rx(
                r"\b(?:human|agent|representative|real person|live person|operator|customer service|"
                r"actual person|advisor|banker)\b"
            ),
        ),
        (
            "talk_to_someone",
            0.8,
            _rx(r"\b(?:talk|speak|chat) (?:to|with) (?:a |an |some )?(?:someone|somebody|person|people)\b"),
        ),
        ("frustration", 0.6, _rx(r"\b(?:this is useless|not helping|doesnt work|you dont understand)\b")),
    ],
    "qna": [
        (
            "branch_atm",
            0.85,
            _rx(
                r"\b(?:branch|branches|atm|atms|cash machine|nearest|near me|opening hours|hours|"
                r"open on|open today|open tomorrow|close|closing)\b"
            ),
        ),
        (
            "fees_rates",
            0.85,
            _rx(
                r"\b(?:fees?|charge for|interest|rates?|apr|apy|overdraft|minimum balance|"
                r"routing number|swift|iban|sort code|limits?)\b"
            ),
        ),
        (
            "products",
            0.8,
            _rx(
                r"\b(?:mortgage rates?|loans?|credit card offers?|certificate of deposit|"
                r"open (?:an|a new) account|new account|apply for|eligible|eligibility)\b"
            ),
        ),
        ("policy", 0.8, _rx(r"\b(?:policy|policies|privacy|terms|dispute|refund|insured|fdic|secure)\b")),
        (
            "how_to",
            0.8,
            _rx(r"\bhow (?:do|can|would|should) i\b|\bhow to\b|\bwhat happens if\b|\bis it possible\b"),
        ),
        ("are_you_open", 0.9, _rx(r"\bwhat time (?:do you|does the|is the)\b|\bare you open\b")),
        ("what_is_question", 0.5, _rx(r"\b(?:whats|what is|what are) (?:the|your)\b")),
    ],
}
# "How do I send money abroad?", "the fee for a wire": a question about the bank, whose action words are
# not a request (unless an amount says otherwise).
_QUESTION_DEMOTION = 0.2

_ACCOUNT_WORDS = _rx(r"\b(checking|current|savings|saving)\b|\b(\w+) account\b")
_CARD_KIND = _rx(r"\b(debit|credit|visa|mastercard)\b(?: card)?")
_LIMIT = _rx(r"\b(?:last|past|recent|latest|previous) (\d{1,2})\b")

# Confirmation vocabulary. A turn confirms only if every word is from it, so "yes but make it sixty" or
# "cancel my card" are not read as an answer to the pending question.
_YES = {
    "yes",
    "yeah",
    "yep",
    "yup",
    "ya",
    "yea",
    "sure",
    "confirm",
    "confirmed",
    "correct",
    "right",
    "ok",
    "okay",
    "affirmative",
    "absolutely",
    "definitely",
    "proceed",
    "approve",
    "approved",
    "go",
    "ahead",
}
_NO = {
    "no",
    "nope",
    "nah",
    "cancel",
    "cancelled",
    "stop",
    "dont",
    "not",
    "negative",
    "abort",
    "wrong",
    "never",
    "mind",
    "nevermind",
}
_STRONG_NO_FIRST = {"no", "nope", "nah", "negative"}
_YES_PHRASES = {
    "do it",
    "send it",
    "pay it",
    "go for it",
    "please do",
    "of course",
    "sure thing",
    "lets do it",
    "make it so",
    "sounds good",
}
_FILLER = {
    "please",
    "thanks",
    "thank",
    "you",
    "it",
    "that",
    "thats",
    "this",
    "do",
    "send",
    "pay",
    "transfer",
    "the",
    "payment",
    "a",
    "um",
    "uh",
    "oh",
    "well",
    "sir",
    "its",
    "is",
    "all",
    "fine",
    "good",
    "great",
    "perfect",
    "and",
    "just",
    "i",
    "said",
    "want",
    "to",
    "now",
    "of",
    "course",
    "lock",
    "unlock",
    "for",
    "thing",
    "lets",
    "make",
    "so",
    "sounds",
}


def confirmation_of(text: str) -> bool | None:
    """True for a plain yes, False for a plain no or cancel, None for anything else (or both)."""
    words = re.sub(r"[^a-z ]+", " ", text.lower().replace("'", "")).split()
    if not words:
        return None
    has_yes = any(w in _YES for w in words) or " ".join(words) in _YES_PHRASES
    has_no = any(w in _NO for w in words)
    if has_yes and has_no:
        return None
    if words[0] in _STRONG_NO_FIRST:
        return False  # "no, send it to joan instead": a refusal first, whatever follows
    if not all(w in _YES or w in _NO or w in _FILLER for w in words):
        return None
    if has_no:
        return False
    return True if has_yes else None


@dataclass
class IntentResult:
    intent: str
    confidence: float
    entities: dict  # keys when known: amount_minor, currency, payee_id, payee_name, date, card, account
    candidates: list[Candidate]
    needs_llm: bool
    ambiguity_reason: str | None
    rules: list[str]  # which patterns fired
    scores: dict[str, float] = field(default_factory=dict)  # every intent's score, for debugging and audit


class IntentClassifier:
    """Transcript -> intent, entities and payee candidates in about a millisecond, with no model."""

    def __init__(self, index: PayeeIndex, threshold: float = 0.75):
        self.index = index
        self.db = index.db
        self.threshold = threshold

    def classify(self, normalized: Normalized) -> IntentResult:  # noqa: C901 - one scoring pass: pattern scores, payee lookup and ambiguity reasons share the turn's state
        text = normalized.text
        confirmation = confirmation_of(text)
        if confirmation is not None:
            return IntentResult(
                "unknown",
                1.0,
                {"confirmation": confirmation},
                [],
                False,
                None,
                ["confirmation_yes" if confirmation else "confirmation_no"],
                {},
            )

        scores: dict[str, float] = {}
        rules: list[str] = []
        for intent, patterns in _PATTERNS.items():
            miss = 1.0
            for rule, weight, pattern in patterns:
                if pattern.search(text):
                    miss *= 1 - weight
                    rules.append(f"{intent}:{rule}")
            scores[intent] = 1 - miss
        if scores["qna"] >= 0.8 and normalized.money is None:
            for intent in ACTION_INTENTS:
                scores[intent] *= _QUESTION_DEMOTION

        entities = self._entities(normalized, text)
        reasons: list[str] = []

        # Payees are looked up only where a name can matter: money intents, lookups, and bare fragments
        # ("fifty dollars to john smith") that are answers to a question the assistant asked.
        nothing_matched = max(scores.values()) < MIN_INTENT_SCORE
        wants_payee = max(scores[i] for i in (*MONEY_INTENTS, "recipient_lookup")) >= 0.4
        candidates: list[Candidate] = []
        payee: Candidate | None = None
        payee_reason: str | None = None
        if wants_payee or nothing_matched or normalized.money is not None:
            candidates = self.index.find_in_utterance(text)
            payee, payee_reason = resolve_payee(candidates)
        if payee is not None:
            entities["payee_id"], entities["payee_name"] = payee.payee_id, payee.display_name
        elif (
            payee_reason in (None, PAYEE_NOT_FOUND) and wants_payee and (spans := self.index.name_spans(text))
        ):
            # A name was said but matches no payee well: keep it, so the refusal can say which.
            entities["payee_name"] = max(spans, key=len)
            payee_reason = PAYEE_NOT_FOUND

        self._boost(scores, rules, normalized, candidates, payee, nothing_matched)
        ranked = sorted(scores.items(), key=lambda kv: -kv[1])
        intent, best = ranked[0]
        if best < MIN_INTENT_SCORE:
            return IntentResult(
                "unknown", round(1 - best, 3), entities, candidates, True, NO_INTENT, rules, _rounded(scores)
            )
        second = max((s for i, s in ranked[1:] if not _compatible(intent, i)), default=0.0)
        confidence = best * (1 - 0.5 * second**2)
        if second >= CONFLICT_SCORE:
            other = next(i for i, s in ranked[1:] if s == second)
            reasons.append(f"{CONFLICTING_INTENTS}: {intent}, {other}")
        elif confidence < self.threshold:
            reasons.append(LOW_CONFIDENCE)

        if intent in MONEY_INTENTS:
            if normalized.money is None:
                reasons.append(MISSING_AMOUNT)
            elif len({(m.amount_minor, m.currency) for m in normalized.amounts}) > 1:
                reasons.append(MULTIPLE_AMOUNTS)
            if payee is None:
                reasons.append(payee_reason or MISSING_PAYEE)
        if intent != "recent_transactions":
            entities.pop("limit", None)

        # A missing amount is not ambiguity: no model can supply it, the policy asks "how much?".
        needs_llm = any(r != MISSING_AMOUNT for r in reasons)
        return IntentResult(
            intent,
            round(confidence, 3),
            entities,
            candidates,
            needs_llm,
            "; ".join(reasons) or None,
            rules,
            _rounded(scores),
        )

    def _boost(
        self,
        scores: dict[str, float],
        rules: list[str],
        normalized: Normalized,
        candidates: list[Candidate],
        payee: Candidate | None,
        nothing_matched: bool,
    ) -> None:
        """Entities as evidence: an amount and a known payee make a money request likelier."""

        def add(intent: str, weight: float, rule: str) -> None:
            scores[intent] = 1 - (1 - scores[intent]) * (1 - weight)
            rules.append(f"{intent}:{rule}")

        money_words = any(scores[i] > 0 for i in MONEY_INTENTS)
        if nothing_matched and (normalized.money is not None or payee is not None):
            # A bare "fifty dollars" or "to john smith": a transfer fragment (answers "how much?", "to
            # whom?").
            intent = "bill_payment" if payee is not None and payee.kind == "biller" else "transfer_money"
            add(intent, 0.6, "fragment")
            return
        if scores["recipient_lookup"] > 0 and candidates and candidates[0].score >= ACCEPT_SCORE:
            add("recipient_lookup", 0.5, "payee_named")
        if normalized.money is not None and money_words:
            for intent in MONEY_INTENTS:
                if scores[intent] > 0:
                    add(intent, 0.5, "amount")
        if payee is not None and money_words:
            # The payee's kind settles transfer vs bill payment when the verb ("pay") fits both.
            if payee.kind == "biller":
                add("bill_payment", 0.5, "payee_biller")
                scores["transfer_money"] = min(scores["transfer_money"], 0.3)
            else:
                add("transfer_money", 0.5, "payee_person")
                scores["bill_payment"] = min(scores["bill_payment"], 0.3)

    def _entities(self, normalized: Normalized, text: str) -> dict:
        entities: dict = {}
        if normalized.money is not None:
            entities["amount_minor"] = normalized.money.amount_minor
            entities["currency"] = normalized.money.currency
        if normalized.date is not None:
            entities["date"] = normalized.date.isoformat()
        if normalized.time_of_day is not None:
            entities["time_of_day"] = normalized.time_of_day
        if (m := _LIMIT.search(text)) and 0 < int(m[1]) <= 50:
            entities["limit"] = int(m[1])
        if normalized.digits or _CARD_KIND.search(text):
            card = self._card(text, normalized.digits)
            if card is not None:
                entities["card"] = card
        if "account" in text or "checking" in text or "saving" in text or "current" in text:
            account = self._account(text)
            if account is not None:
                entities["account"] = account
        return entities

    def _card(self, text: str, digits: list[str]) -> str | None:
        cards = self.db.cards()
        for d in digits:
            for c in cards:
                if c["last4"] == d[-4:]:
                    return c["card_id"]
        if m := _CARD_KIND.search(text):
            word = m[1]
            for c in cards:
                if word in (c["kind"], c["network"]):
                    return c["card_id"]
        return None

    def _account(self, text: str) -> str | None:
        accounts = self.db.accounts()
        for m in _ACCOUNT_WORDS.finditer(text):
            word = {"current": "checking", "saving": "savings"}.get(m[1] or "", m[1] or m[2])
            for a in accounts:
                if word in (a["name"], a["currency"].lower(), a["account_id"]):
                    return a["account_id"]
        return None


def resolve_payee(candidates: list[Candidate]) -> tuple[Candidate | None, str | None]:
    """The one candidate meant, or None and why: not found, or several too close to choose."""
    if not candidates or candidates[0].score < ACCEPT_SCORE:
        return None, PAYEE_NOT_FOUND if candidates else None
    close = close_candidates(candidates)
    if len(close) == 1:
        return close[0], None
    return None, f"{AMBIGUOUS_PAYEE}: {', '.join(c.display_name for c in close)}"


def close_candidates(candidates: list[Candidate]) -> list[Candidate]:
    """The top candidate and those within PAYEE_MARGIN of it; only the top one if it is the sole exact
    match (the full name said exactly: the confirmation reads it back in any case)."""
    if not candidates or candidates[0].score < ACCEPT_SCORE:
        return []
    top = candidates[0]
    rivals = [c for c in candidates[1:] if c.score > top.score - PAYEE_MARGIN]
    if top.score >= 100.0 and all(c.score < 100.0 for c in rivals):
        return [top]
    return [top, *rivals]


def _compatible(a: str, b: str) -> bool:
    # Two readings of the same request, not two requests: "pay" is a transfer or a bill payment.
    return {a, b} <= set(MONEY_INTENTS)


def _rounded(scores: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in scores.items() if v > 0}
