"""The assistant's spoken domain: intent phrasings, spoken amounts and payee names, as the sentence corpus
and slot templates that bias the speech recogniser (an n-gram LM or a grammar is built from them in
asr.py)."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field

AMOUNT_SLOT = "{amount}"
NAME_SLOT = "{name}"

_ONES = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
)
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")

# Each family is one intent (or dialogue act); its phrasings share the family's weight in the corpus, so
# the LM's prior over intents does not follow how many amount x name combinations a family happens to
# expand to. Transfers get more because they carry the words most worth getting right (amounts, names).
_FAMILIES: dict[str, tuple[float, tuple[str, ...]]] = {
    "balance": (
        1.0,
        (
            "what's my balance",
            "what is my balance",
            "check my balance",
            "check my account balance",
            "what's my checking balance",
            "what's my savings balance",
            "what is my checking account balance",
            "what is the balance of my savings account",
            "how much money do i have",
            "how much money is in my account",
            "how much is in my checking account",
            "how much do i have in savings",
            "show me my balance",
            "tell me my balance",
            "account balance",
            "balance",
            "what's in my account",
            "can you check my balance please",
        ),
    ),
    "transactions": (
        1.0,
        (
            "show my recent transactions",
            "show me my recent transactions",
            "what are my recent transactions",
            "what were my last five transactions",
            "show my last ten transactions",
            "list my transactions",
            "show my last three transactions",
            "recent transactions",
            "transaction history",
            "show me my recent activity",
            "what did i spend this week",
            "what did i spend last month",
            "what are my latest purchases",
            "show my account activity",
            "what were my last two payments",
            "did i pay " + NAME_SLOT,
            "when did i last pay " + NAME_SLOT,
        ),
    ),
    "transfer": (
        3.0,
        (
            "transfer {amount} to {name}",
            "send {amount} to {name}",
            "pay {name} {amount}",
            "pay {amount} to {name}",
            "send {name} {amount}",
            "wire {amount} to {name}",
            "transfer {amount} to {name} please",
            "i want to transfer {amount} to {name}",
            "i'd like to send {amount} to {name}",
            "can you send {amount} to {name}",
            "please pay {name} {amount}",
            "move {amount} from checking to savings",
            "transfer {amount} from savings to checking",
            "transfer {amount} from my savings to {name}",
            "give {name} {amount}",
            "send money to {name}",
            "transfer money to {name}",
            "pay {name}",
            "send {amount}",
            "transfer {amount}",
            "{amount}",
            "{name}",
            "to {name}",
        ),
    ),
    "bill": (
        1.0,
        (
            "pay my electric bill",
            "pay the electric bill",
            "pay my electricity bill",
            "pay my water bill",
            "pay my phone bill",
            "pay my internet bill",
            "pay my gas bill",
            "pay my cable bill",
            "pay my credit card bill",
            "pay my rent",
            "pay my mortgage",
            "pay my bills",
            "pay {amount} on my electric bill",
            "pay {amount} toward my credit card",
            "pay my bill to {name}",
            "when is my electric bill due",
            "how much is my electric bill",
        ),
    ),
    "card": (
        1.0,
        (
            "lock my card",
            "lock my debit card",
            "lock my credit card",
            "freeze my card",
            "freeze my debit card",
            "block my card",
            "block my credit card",
            "unlock my card",
            "unfreeze my card",
            "i lost my card",
            "i lost my wallet",
            "my card was stolen",
            "someone stole my card",
            "cancel my card",
            "turn off my card",
            "please lock my card right now",
        ),
    ),
    "human": (
        1.0,
        (
            "talk to a person",
            "talk to a human",
            "i want to talk to a person",
            "i want to talk to a human",
            "let me talk to someone",
            "speak to an agent",
            "speak to a representative",
            "i need a human",
            "connect me to a representative",
            "can i speak to someone",
            "customer service",
            "agent",
            "representative",
            "operator",
            "human please",
            "get me a real person",
        ),
    ),
    "dialogue": (
        1.0,
        (
            "yes",
            "no",
            "yeah",
            "yep",
            "nope",
            "yes please",
            "no thanks",
            "no thank you",
            "confirm",
            "cancel",
            "correct",
            "that's right",
            "that's correct",
            "that's wrong",
            "go ahead",
            "do it",
            "stop",
            "never mind",
            "wait",
            "hello",
            "hi",
            "thank you",
            "thanks",
            "goodbye",
            "bye",
            "help",
            "what can you do",
            "start over",
            "repeat that",
        ),
    ),
}

_CURRENCIES = ("dollars", "bucks", "euros", "pounds")
# Amounts each template is paired with when the corpus is expanded; names are cycled the same way so that
# every local trigram (verb-amount, amount-"to"-name) shows up without the full cross product.
_CENTS = (5, 10, 25, 50, 75, 99)


def spoken_number(n: int) -> str:
    """English words for 0 <= n < 1,000,000 ("one hundred twenty five"), as people say amounts."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"spoken_number supports 0..999999, got {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (" " + _ONES[ones] if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return _ONES[hundreds] + " hundred" + (" " + spoken_number(rest) if rest else "")
    thousands, rest = divmod(n, 1000)
    return spoken_number(thousands) + " thousand" + (" " + spoken_number(rest) if rest else "")


def spoken_amounts() -> list[str]:
    """Spoken money amounts: whole dollars up to thousands, "and N cents", "a hundred", other currencies."""
    values = list(range(1, 100)) + [h * 100 + r for h in range(1, 10) for r in (0, 5, 10, 20, 25, 50, 75)]
    values += [1000, 1200, 1500, 2000, 2500, 3000, 5000, 10000, 20000]
    amounts = []
    for value in values:
        unit = "dollar" if value == 1 else "dollars"
        amounts.append(f"{spoken_number(value)} {unit}")
    amounts += [
        "a hundred dollars",
        "a thousand dollars",
        "one hundred and fifty dollars",
        "two hundred and fifty dollars",
        "one dollar and fifty cents",
        "twelve fifty",
        "nineteen ninety nine",
        "fifty cents",
        "ninety nine cents",
    ]
    amounts += [
        f"{spoken_number(d)} dollars and {spoken_number(c)} cents"
        for d in (2, 10, 20, 45, 100)
        for c in _CENTS
    ]
    amounts += [
        f"{spoken_number(v)} {c}" for c in _CURRENCIES[1:] for v in (5, 10, 20, 40, 50, 100, 200, 500)
    ]
    return amounts


def spoken_words(text: str) -> list[str]:
    """Lower-case ASCII word tokens as the recogniser's dictionary spells them ("García-López" -> garcia
    lopez)."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.findall(r"[a-z]+(?:'[a-z]+)*", ascii_text.lower())


@dataclass
class DomainVocabulary:
    """What users of the banking assistant say; rebuild with `build` (and a new version) when payees
    change."""

    phrases: list[str]  # the LM corpus: lower-case space-separated sentences
    payee_names: list[str]  # as given, for display and for callers that diff vocabularies
    version: int
    weights: list[float] = field(default_factory=list)  # corpus weight per phrase; empty: 1 each
    templates: list[str] = field(default_factory=list)  # phrasings with {amount}/{name} slots (grammars)
    amounts: list[str] = field(default_factory=list)  # spoken amount phrases
    names: list[str] = field(default_factory=list)  # spoken name forms: "john smith", "john", "my mom"

    @classmethod
    def build(cls, payee_names: list[str], version: int = 0, aliases: Iterable[str] = ()) -> DomainVocabulary:
        """Intent phrasings x amounts x payee names (full name and first name) and `aliases` ("my landlord").

        Slots are filled by cycling: each template appears with every name and with every amount, not with
        every pair, so the corpus stays a few thousand sentences for a few hundred payees.
        """
        names = _name_forms(payee_names, aliases)
        amounts = spoken_amounts()
        phrases: list[str] = []
        weights: list[float] = []
        templates: list[str] = []
        for weight, family in _FAMILIES.values():
            expanded = [s for t in family for s in _expand(t, amounts, names)]
            templates += family
            phrases += expanded
            weights += [weight / len(expanded)] * len(expanded)
        # Payees that are billers ("city electric") are said as "pay city electric" too; that is in the
        # transfer templates already, so nothing separate is needed here.
        return cls(
            phrases=phrases,
            payee_names=list(payee_names),
            version=version,
            weights=weights,
            templates=templates,
            amounts=amounts,
            names=names,
        )

    def words(self) -> set[str]:
        """Every word the recogniser must be able to say."""
        return {w for phrase in self.phrases for w in phrase.split()}

    def weighted_phrases(self) -> list[tuple[str, float]]:
        weights = self.weights or [1.0] * len(self.phrases)
        return list(zip(self.phrases, weights, strict=True))


def _name_forms(payee_names: Iterable[str], aliases: Iterable[str]) -> list[str]:
    forms: dict[str, None] = {}  # ordered set: deterministic corpus for a given payee list
    for name in payee_names:
        words = spoken_words(name)
        if words:
            forms[" ".join(words)] = None
            forms[words[0]] = None  # "pay john"
    for alias in aliases:
        words = spoken_words(alias)
        if words:
            forms[" ".join(words)] = None
            if words[0] != "my":
                forms[" ".join(["my", *words])] = None  # "send fifty dollars to my mom"
    return list(forms)


def _expand(template: str, amounts: list[str], names: list[str]) -> list[str]:
    has_amount, has_name = AMOUNT_SLOT in template, NAME_SLOT in template
    if has_name and not names:
        return []  # no payees yet: a name template cannot be said
    if not has_amount and not has_name:
        return [" ".join(spoken_words(template))]
    rows = max(len(amounts) if has_amount else 1, len(names) if has_name else 1)
    out = []
    for i in range(rows):
        text = template
        if has_amount:
            text = text.replace(AMOUNT_SLOT, amounts[i % len(amounts)])
        if has_name:
            text = text.replace(NAME_SLOT, names[i % len(names)])
        out.append(" ".join(spoken_words(text)))
    return out
