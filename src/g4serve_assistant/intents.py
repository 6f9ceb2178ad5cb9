"""Fast intent path (no LLM): weighted regex patterns over the normalized transcript, entities from the
normalizer and the payee index, and a confidence with the reason when the LLM should look instead."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from g4serve_assistant.normalize import Normalized
from g4serve_assistant.payees import ACCEPT_SCORE, Candidate, PayeeIndex

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

# Payee resolution: a candidate is taken when it scores ACCEPT_SCORE (payees.py) or more and leads the next
# one by more than PAYEE_MARGIN points (or is the only exact match); otherwise the payee is ambiguous.
PAYEE_MARGIN = 8.0
FRAGMENT_PAYEE_SCORE = 90.0  # a payee named this well makes a bare name a money request ("to john smith")
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
# Phrasings are how callers talk to a phone bank: indirect ("I was wondering what's in my account"), British
# and American ("current account", "chequing", "nicked", "put a stop on it"), and around the word itself
# ("take the block off", "what's gone out").
_CARD = r"(?:cards?|visa|mastercard|amex)"  # what a caller locks or unlocks
_PATTERNS: dict[str, list[tuple[str, float, re.Pattern]]] = {
    "balance_inquiry": [
        ("balance", 0.9, _rx(r"\bbalances?\b")),
        (
            "how_much_have",
            0.85,
            _rx(
                r"\bhow much (?:money |cash |funds )?(?:do i have|have i got|ive got|i have|i got|have i|"
                r"is (?:there |left )?(?:in|on)|is left|left)\b"
            ),
        ),
        ("available_funds", 0.85, _rx(r"\bavailable (?:funds|balance|credit)\b|\bfunds available\b")),
        (
            "whats_in_account",
            0.85,
            _rx(r"\b(?:whats|what is) in my (?:\w+ )?(?:checking|chequing|current|savings|account)\b"),
        ),
        (
            "account_standing",
            0.8,
            # "what's my checking at", "how's my savings looking"; not its number, rate or fees.
            _rx(
                r"\b(?:whats|what is|hows|how is|how are) my (?:checking|chequing|current|savings?|accounts?)"
                r"(?: account)?(?: at| looking| look| doing)?\b"
                r"(?!.*\b(?:number|rates?|interest|fees?|limits?)\b)"
            ),
        ),
        ("overdrawn", 0.8, _rx(r"\b(?:am i|is my account) overdrawn\b|\bin the (?:red|black)\b")),
        (
            "money_in_account",
            0.85,
            _rx(
                r"\b(?:is there|have i got|do i have|any) (?:any )?(?:money|funds|cash) (?:in|on|left)\b|"
                r"\b(?:check|know|see) (?:my )?(?:funds|money)\b"
            ),
        ),
        ("enough", 0.85, _rx(r"\b(?:do i have|have i got|is there) enough\b")),
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
                r"\b(?:what|where|how much) (?:did i|have i|ive)(?: been)? "
                r"(?:spend|spent|spending|buy|bought)\b|"
                r"\bmy spending\b|\bthings i (?:bought|spent|paid)\b"
            ),
        ),
        ("did_i_pay", 0.85, _rx(r"\b(?:did i|when did i|have i) (?:last |already )?(?:pay|paid)\b")),
        # Money that moved: "what's gone out", "has my salary come in", "did my rent go through".
        (
            "money_moved",
            0.85,
            _rx(
                r"\b(?:gone|went|came|going|coming) (?:out|in|through)\b|\bcome (?:in|out|through) yet\b|"
                r"\b(?:has|have|did)\b.*\bcome (?:in|through)\b|"
                r"\b(?:go|gone|went) through\b|\bget paid\b|\bbeen paid\b"
            ),
        ),
        (
            "was_there",
            0.8,
            _rx(
                r"\b(?:was there|were there|any) (?:a |an |any )?(?:payments?|charges?|transactions?|"
                r"deposits?|purchases?)\b|\bthat (?:charge|payment|transaction)\b"
            ),
        ),
        ("transactions_word", 0.6, _rx(r"\btransactions?\b")),
    ],
    "transfer_money": [
        (
            "send_verb",
            0.75,
            _rx(r"\b(?:send|sending|transfer|transferring|wire|zelle|venmo|interac|reimburse|remit)\b"),
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
        ("make_payment", 0.7, _rx(r"\bmake (?:a |the )?payment\b|\bsettle (?:up|my|the|our|this)\b")),
    ],
    "card_lock": [
        (
            "lock_card",
            0.9,
            _rx(
                r"\b(?:lock|freeze|block|disable|suspend|deactivate|cancel|turn off|stop)\b(?: \w+){0,3} "
                + _CARD
                + r"\b"
            ),
        ),
        (
            "lost_stolen",
            0.9,
            _rx(
                r"\b(?:lost|stolen|stole|nicked|pinched|missing|misplaced|cant find)\b(?: \w+){0,4} "
                r"(?:cards?|wallet|purse|visa|mastercard)\b|"
                r"\bleft (?:my|the) (?:\w+ )?(?:cards?|wallet|purse)\b|"
                r"\b(?:cards?|wallet|purse|visa|mastercard) (?:is |was |has been |got |been )?"
                r"(?:lost|stolen|missing|nicked|pinched)\b"
            ),
        ),
        ("put_a_stop", 0.9, _rx(r"\b(?:put|place) (?:a )?(?:stop|hold|block|freeze|lock) on\b")),
        (
            "someone_using",
            0.85,
            _rx(r"\b(?:someone|somebody|someones|somebodys)(?: has| is)?(?: been)? (?:using|used)\b"),
        ),
        ("lock_word", 0.6, _rx(r"\b(?:lock|freeze|block)\b")),
        ("fraud", 0.6, _rx(r"\b(?:fraud|fraudulent|unauthori[sz]ed)\b")),
        # "payments on my card I didn't make": the card comes first, since it may be in a thief's hands.
        (
            "not_mine",
            0.85,
            _rx(
                r"\b(?:didnt make|dont recogni[sz]e|didnt authori[sz]e|wasnt me|not mine)\b.*\b"
                + _CARD
                + r"\b|"
                r"\b"
                + _CARD
                + r"\b.*\b(?:didnt make|dont recogni[sz]e|didnt authori[sz]e|wasnt me|not mine)\b"
            ),
        ),
    ],
    "card_unlock": [
        (
            "unlock_card",
            0.9,
            _rx(
                r"\b(?:unlock|unfreeze|unblock|reactivate|re enable|reenable|enable|turn on|activate)\b"
                r"(?: \w+){0,3} (?:" + _CARD + r"|it|them)\b"
            ),
        ),
        ("found_card", 0.85, _rx(r"\bfound (?:my |the )?(?:\w+ )?(?:card|wallet|purse)\b")),
        ("unlock_word", 0.6, _rx(r"\b(?:unlock|unfreeze|unblock)\b")),
        # "take the block off", "remove the lock": the lock word names what goes, not what is asked.
        (
            "remove_lock",
            0.9,
            _rx(
                r"\b(?:remove|lift|take off|take away|take)\b(?: \w+){0,2} (?:lock|block|freeze|hold|stop)\b"
            ),
        ),
        (
            "back_on",
            0.85,
            _rx(r"\b(?:turn|switch|put) (?:it|them|my (?:\w+ )?" + _CARD + r"|the " + _CARD + r") back on\b"),
        ),
        ("turned_up", 0.75, _rx(r"\b(?:turned up|found it|got it back)\b")),
        ("use_again", 0.85, _rx(r"\buse (?:it|them|my (?:\w+ )?" + _CARD + r") again\b")),
    ],
    "recipient_lookup": [
        ("is_payee", 0.9, _rx(r"\b(?:is|are|do i have|have i got)\b.*\b(?:payees?|recipients?|contacts?)\b")),
        (
            "list_payees",
            0.9,
            _rx(
                r"\b(?:list|show|who are|read|tell)(?: me)?(?: all)?(?: of)?(?: my| the)? (?:saved )?"
                r"(?:payees|recipients|contacts)\b|\b(?:payee|recipient|contact)s? list\b|"
                r"\blist of (?:payees|recipients|contacts)\b|\bsaved (?:as )?(?:payees|recipients)\b"
            ),
        ),
        (
            "on_file",
            0.85,
            _rx(
                r"\b(?:is|are|do i have|have i(?: got| added)?|did i (?:add|save))\b.*"
                r"\b(?:on file|set up|saved|added|on (?:my|the) (?:payee )?list)\b"
            ),
        ),
        ("who_can_i_pay", 0.9, _rx(r"\bwho (?:can|could) i (?:send|pay|transfer)\b")),
        ("find_payee", 0.75, _rx(r"(?<!cant )(?<!cannot )\b(?:find|look up|lookup|search for)\b")),
        ("who_is", 0.6, _rx(r"\bwho is\b")),
        ("payee_word", 0.6, _rx(r"\b(?:payees?|recipients?)\b")),
    ],
    "human_handoff": [
        (
            "agent",
            0.95,
            _rx(
                r"\b(?:human|agent|representative|real person|live person|operator|customer service|"
                r"actual person|advisor|adviser|banker|(?:your|a) (?:manager|supervisor))\b"
            ),
        ),
        (
            "talk_to_someone",
            0.85,
            _rx(
                r"\b(?:talk|speak|chat)\b.*\b(?:someone|somebody|person|people)\b|"
                r"\b(?:someone|somebody|person) (?:i can |to )?(?:talk|speak)\b"
            ),
        ),
        (
            "put_through",
            0.9,
            _rx(
                r"\b(?:put me through|transfer me|connect me|pass me)\b|"
                r"\b(?:fraud|security|claims|complaints?|mortgage|loans?) (?:team|department)\b"
            ),
        ),
        ("complaint", 0.85, _rx(r"\b(?:complaint|complain)\b")),
        ("call_back", 0.85, _rx(r"\b(?:call|ring|phone) me(?: back)?\b|\bcall ?back\b")),
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
                r"routing number|swift|iban|sort code|limits?)\b|\bcost(?:s)? to\b|\bdo you charge\b|"
                r"\bhow much (?:does it|would it|will it|is it to)\b"
            ),
        ),
        (
            "products",
            0.8,
            _rx(
                r"\b(?:mortgage rates?|loans?|credit card offers?|certificate of deposit|"
                r"open (?:an|a new|a) (?:\w+ )?account|new account|apply for|eligible|eligibility)\b|"
                r"\b(?:can i get|can i have|could i get) (?:a |an )?"
                r"(?:mortgage|loan|credit card|overdraft)\b|"
                r"\bdo you (?:do|offer|have) (?:\w+ )?(?:accounts?|mortgages?|loans?|isas?|savings)\b"
            ),
        ),
        (
            "policy",
            0.8,
            _rx(
                r"\b(?:policy|policies|privacy|terms|dispute|refund|insured|fdic|secure|protected|guarantee)\b"
            ),
        ),
        (
            "how_to",
            0.8,
            _rx(
                r"\bhow (?:do|can|would|should) i\b|\bhow to\b|\bwhat happens if\b|\bis it possible\b|"
                r"\bhow (?:long|soon|quickly) (?:does|do|will|would|is)\b"
            ),
        ),
        ("are_you_open", 0.9, _rx(r"\bwhat time (?:do you|does the|is the)\b|\bare you open\b")),
        # Weak alone ("what's the weather"): below MIN_INTENT_SCORE unless another rule agrees.
        ("what_is_question", 0.45, _rx(r"\b(?:whats|what is|what are) (?:the|your)\b")),
    ],
}
# "How do I send money abroad?", "the fee for a wire": a question about the bank, whose action words are
# not a request (unless an amount says otherwise).
_QUESTION_DEMOTION = 0.2
# Rules whose phrasing rules out readings that its words would also fire, demoted as questions are: "can
# you transfer me to the fraud team" asks for a person, not a transfer; "take the block off" asks for no
# lock; "when did I last pay the electric bill" asks about the past.
_RULES_OUT: dict[str, tuple[str, ...]] = {
    # A caller who asks for a person wants the person, whatever it is about: "about my card", "a transfer".
    "human_handoff:put_through": (*ACTION_INTENTS, "qna"),
    "human_handoff:talk_to_someone": (*ACTION_INTENTS, "qna"),
    "card_unlock:remove_lock": ("card_lock",),
    "recipient_lookup:who_can_i_pay": MONEY_INTENTS,
    "recipient_lookup:on_file": MONEY_INTENTS,
    "recent_transactions:did_i_pay": MONEY_INTENTS,
    "recent_transactions:money_moved": MONEY_INTENTS,
    "balance_inquiry:enough": MONEY_INTENTS,
}

_ACCOUNT_WORDS = _rx(r"\b(checking|chequing|current|savings|saving)\b|\b(\w+) account\b")
# What callers call the main account (British "current", Canadian "chequing") and the savings account.
_ACCOUNT_NAMES = {"current": "checking", "chequing": "checking", "saving": "savings"}
_ACCOUNT_CUES = ("account", "checking", "chequing", "saving", "current")
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
    # keys when known: amount_minor, currency, payee_id, payee_name, date (ISO, or the words of a date that
    # does not exist), card, account
    entities: dict
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
        for ruled_out in {i for rule in rules for i in _RULES_OUT.get(rule, ())}:
            scores[ruled_out] *= _QUESTION_DEMOTION  # after the boosts: an amount does not make it a request
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
        named = payee is not None and payee.score >= FRAGMENT_PAYEE_SCORE
        if nothing_matched and (normalized.money is not None or named):
            # A bare "fifty dollars" or "to john smith": a transfer fragment (answers "how much?", "to
            # whom?"). A name only like a payee's ("weather" for the alias "water") is no fragment.
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
        elif normalized.invalid_date is not None:
            # "february 30th" as said, not ISO: the policy asks for a valid date instead of paying today.
            entities["date"] = normalized.invalid_date
        if normalized.time_of_day is not None:
            entities["time_of_day"] = normalized.time_of_day
        if (m := _LIMIT.search(text)) and 0 < int(m[1]) <= 50:
            entities["limit"] = int(m[1])
        if normalized.digits or _CARD_KIND.search(text):
            card = self._card(text, normalized.digits)
            if card is not None:
                entities["card"] = card
        if any(word in text for word in _ACCOUNT_CUES):
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
            word = _ACCOUNT_NAMES.get(m[1] or "", m[1] or m[2])
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
