"""Deterministic transcript normalization: casing and width, spoken numbers, money in minor units, digit
strings, relative dates. Every rule that changes or extracts something is logged for the audit trail."""

from __future__ import annotations

import calendar
import datetime as dt
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from text_to_num import alpha2digit

# ISO 4217 minor-unit exponents of the currencies the assistant understands.
_EXPONENTS = {
    "USD": 2,
    "EUR": 2,
    "GBP": 2,
    "INR": 2,
    "CAD": 2,
    "AUD": 2,
    "NZD": 2,
    "SGD": 2,
    "HKD": 2,
    "CHF": 2,
    "CNY": 2,
    "MXN": 2,
    "SEK": 2,
    "NOK": 2,
    "DKK": 2,
    "BRL": 2,
    "ZAR": 2,
    "AED": 2,
    "JPY": 0,
    "KRW": 0,
    "VND": 0,
    "CLP": 0,
    "ISK": 0,
    "KWD": 3,
    "BHD": 3,
    "OMR": 3,
    "JOD": 3,
    "TND": 3,
}
_SYMBOLS = {"USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥", "INR": "₹", "KRW": "₩", "CAD": "CA$", "AUD": "A$"}
_DOLLAR_FAMILY = ("USD", "CAD", "AUD", "NZD", "SGD", "HKD")
_DOLLAR = "$"  # a bare "dollars": the customer's default currency if it is a dollar, else USD

# Spoken and written currency names -> ISO code. Longer names first in the regex, so "canadian dollars"
# wins over "dollars".
_CURRENCY_NAMES = {
    "us dollars": "USD",
    "us dollar": "USD",
    "american dollars": "USD",
    "usd": "USD",
    "dollars": _DOLLAR,
    "dollar": _DOLLAR,
    "bucks": _DOLLAR,
    "buck": _DOLLAR,
    "canadian dollars": "CAD",
    "canadian dollar": "CAD",
    "cad": "CAD",
    "australian dollars": "AUD",
    "australian dollar": "AUD",
    "aud": "AUD",
    "euros": "EUR",
    "euro": "EUR",
    "eur": "EUR",
    "british pounds": "GBP",
    "pounds sterling": "GBP",
    "pounds": "GBP",
    "pound": "GBP",
    "quid": "GBP",
    "sterling": "GBP",
    "gbp": "GBP",
    "japanese yen": "JPY",
    "yen": "JPY",
    "jpy": "JPY",
    "indian rupees": "INR",
    "rupees": "INR",
    "rupee": "INR",
    "rs": "INR",
    "inr": "INR",
    "korean won": "KRW",
    "won": "KRW",
    "krw": "KRW",
    "chinese yuan": "CNY",
    "yuan": "CNY",
    "renminbi": "CNY",
    "rmb": "CNY",
    "cny": "CNY",
    "swiss francs": "CHF",
    "swiss franc": "CHF",
    "francs": "CHF",
    "franc": "CHF",
    "chf": "CHF",
    "mexican pesos": "MXN",
    "pesos": "MXN",
    "peso": "MXN",
    "mxn": "MXN",
    "kuwaiti dinars": "KWD",
    "kuwaiti dinar": "KWD",
    "kwd": "KWD",
    "bahraini dinars": "BHD",
    "bahraini dinar": "BHD",
    "bhd": "BHD",
}
_CODES_BEFORE = (
    "usd",
    "eur",
    "gbp",
    "jpy",
    "inr",
    "rs",
    "krw",
    "cny",
    "chf",
    "cad",
    "aud",
    "mxn",
    "kwd",
    "bhd",
)
_SYMBOL_CURRENCY = {"$": _DOLLAR, "€": "EUR", "£": "GBP", "¥": "JPY", "₹": "INR", "₩": "KRW"}
_SYMBOL_PREFIX = {"us": "USD", "c": "CAD", "a": "AUD"}  # us$, c$, a$
# Minor-unit words: None means "the currency of the sentence" (cents of dollars or of euros).
_MINOR_NAMES = {"cents": None, "cent": None, "pence": "GBP", "p": "GBP", "paise": "INR", "centavos": "MXN"}

_NUM = r"\d+(?:\.\d+)?"
# Where a number may start: not inside another one ("1.5 cents" is not 5 cents, "1/2 dollars" not 2 dollars).
_AT = r"(?<![\d./])\b"
_CUR = "|".join(sorted(map(re.escape, _CURRENCY_NAMES), key=len, reverse=True))
_MINOR = "|".join(sorted(_MINOR_NAMES, key=len, reverse=True))
_SYM = "[$€£¥₹₩]"
# Words after a number that make it something other than an amount: a date, a time, a count.
_NOT_AMOUNT = (
    r"(?:st|nd|rd|th|days?|weeks?|months?|years?|am|pm|oclock|%|percent|times|"
    r"transactions?|payments?|purchases?|digits?)\b"
)
_MAX_MINOR = 10**15

_MONEY_PATTERNS: list[tuple[str, re.Pattern]] = [
    (
        "money_symbol",
        re.compile(
            rf"(?<![\w$€£¥₹₩])(?P<pre>us|c|a)?(?P<sym>{_SYM}) ?(?P<n>{_NUM})(?![./\d])(?: (?P<cw>{_CUR}))?\b"
        ),
    ),
    ("money_symbol_after", re.compile(rf"{_AT}(?P<n>{_NUM}) ?(?P<sym>{_SYM})")),
    # "12 50 dollars" (spoken "twelve fifty dollars"): twelve dollars fifty, not 1250 dollars.
    ("money_pair", re.compile(rf"{_AT}(?P<major>\d{{1,3}}) (?P<minor>\d{{2}}) (?P<cw>{_CUR})\b")),
    (
        "money_words",
        re.compile(
            # "5 dollars and 1.5 cents": the minor part is read whole, and refused, never as 1 cent.
            rf"{_AT}(?P<n>{_NUM}) (?P<cw>{_CUR})\b(?:(?: and)? (?P<m>\d{{1,3}}(?:\.\d+)?)(?![.\d])"
            rf"(?: (?P<mw>{_MINOR}))?\b"
            rf"(?! (?:{_CUR}|{_NOT_AMOUNT})))?"
        ),
    ),
    ("money_code_before", re.compile(rf"\b(?P<cw>{'|'.join(_CODES_BEFORE)}) ?(?P<n>{_NUM})\b(?![./\d])")),
    # "1.5 cents" is read whole and refused (a fraction of a cent), not as the "5 cents" after the point.
    ("money_minor_only", re.compile(rf"{_AT}(?P<m>{_NUM}) ?(?P<mw>{_MINOR})\b")),
]
_CURRENCY_MENTION = re.compile(rf"(?:\b(?:{_CUR})\b|{_SYM})")
_MONEY_VERBS = re.compile(
    r"\b(?:send|sending|transfer|transferring|pay|paying|wire|give|move|zelle|venmo|"
    r"reimburse|owe|deposit)\b"
)
_BARE_PAIR = re.compile(rf"{_AT}(?P<major>\d{{1,3}}) (?P<minor>\d{{2}})\b(?! ?{_NOT_AMOUNT})(?![./\d])")
_BARE_NUM = re.compile(rf"{_AT}(?P<n>{_NUM})\b(?! ?{_NOT_AMOUNT})(?![.:/\d])")
# A fraction said or written as an amount: "half a dollar" (-> "half 1 dollar"), "a quarter of a million
# dollars", "a dollar and a half", "25 and a half euros", "1/2 dollars", "1/2 a dollar", "usd 1/2". Refused:
# read any other way it becomes a different amount ($1, $1,000,000, $1, €25, $2, $1, $1).
_FRACTION_AMOUNT = re.compile(
    rf"\b(?:half|halves|quarters?)(?: of)? \d|\bthirds? of \d|"
    rf"\d (?:{_CUR}|{_MINOR}) and (?:an?|one|1) (?:half|quarter)\b|"
    rf"\d and (?:an?|one|1) (?:half|quarter) (?:{_CUR}|{_MINOR})\b|"
    rf"(?:{_SYM}|\b(?:{'|'.join(_CODES_BEFORE)})) ?\d+/\d+|"
    rf"\d+/\d+ ?(?:{_CUR}|{_MINOR}|1 (?:{_CUR}|{_MINOR}))\b|\d+/\d+ of \d"
)
_NOT_AMOUNT_BEFORE = {
    "last",
    "the",
    "at",
    "in",
    "on",
    "within",
    "next",
    "past",
    "first",
    "top",
    "ending",
    "number",
}

_DIGIT_WORDS = {
    "zero": "0",
    "oh": "0",
    "o": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
}
_REPEAT_WORDS = {"double": 2, "triple": 3}
_DIGIT_CUES = {"ending", "ends", "digits", "number", "account", "card", "last"}
_SCALE_WORDS = {"hundred", "thousand", "million", "billion", "point", "and"}
_CUE_DIGITS = re.compile(
    r"\b(?P<cue>(?:ending|ends) (?:in|with) |last (?:4|four) (?:digits )?(?:are |is )?|"
    r"(?:account|card) (?:number )?(?:is )?)(?P<d>\d+(?: \d+)*)\b(?![.:])"
)
_SMALL_NUMBERS = re.compile(
    rf"\b(zero|one|two)\b(?= (?:{_CUR}|{_MINOR}|hundred|thousand|grand|am|pm|oclock|"
    r"days?|weeks?|transactions?|payments?|\d))"
)
_SMALL_VALUES = {"zero": "0", "one": "1", "two": "2"}
_ARTICLE_NUMBER = re.compile(
    r"\ban? (hundred|thousand|million|dollar|buck|euro|pound|quid|yen|rupee|grand)\b"
)
# A note by its nickname: "a tenner", "a fiver", in the customer's own currency (pounds in the UK, dollars
# in the US).
_NOTE_NICKNAME = re.compile(r"\b(?:an? |one )?(fiver|tenner)\b")
_NOTE_VALUES = {"fiver": "5", "tenner": "10"}
_SCALE = re.compile(r"\b(\d+(?:\.\d+)?) ?(k|grand|thousand|million|billion)\b")
_SCALE_VALUES = {"k": 1000, "grand": 1000, "thousand": 1000, "million": 10**6, "billion": 10**9}

_WEEKDAYS = {
    d: i for i, d in enumerate(("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"))
}
_MAX_DAYS_AHEAD = 36_600
_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_name) if name}
_MONTHS |= {name.lower(): i for i, name in enumerate(calendar.month_abbr) if name} | {"sept": 9}
_MONTH_RE = "|".join(sorted(_MONTHS, key=len, reverse=True))
_ORD = r"(?:st|nd|rd|th)"
_ORDINAL_WORDS = {"first": 1, "second": 2, "third": 3}
_DATE_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("date_iso", re.compile(r"\b(?P<y>\d{4})-(?P<mo>\d{2})-(?P<d>\d{2})\b")),
    # "on 3/15", "by 4/5/2025": which is the day and which the month is unknown, so never resolved (asked).
    ("date_numeric", re.compile(r"\b(?:on|by|until|before) \d{1,4}/\d{1,2}(?:/\d{2,4})?\b(?!/)")),
    (
        "date_relative",
        re.compile(r"\b(?:the )?day after tomorrow\b|\btomorrow\b|\btoday\b|\btonight\b|\byesterday\b"),
    ),
    ("date_in", re.compile(r"\bin (?P<n>\d+|an?|one|two) (?P<unit>days?|weeks?)\b")),
    ("date_weekday", re.compile(rf"\b(?:(?:next|this|coming|on) )?(?P<wd>{'|'.join(_WEEKDAYS)})\b")),
    ("date_month_day", re.compile(rf"\b(?P<mon>{_MONTH_RE}) (?:the )?(?P<d>\d{{1,2}}){_ORD}?\b")),
    ("date_day_month", re.compile(rf"\b(?:the )?(?P<d>\d{{1,2}}){_ORD} (?:of )?(?P<mon>{_MONTH_RE})\b")),
    (
        "date_day_of_month",
        re.compile(
            rf"\b(?:on )?the (?P<d>\d{{1,2}}){_ORD}\b|\bon (?P<d2>\d{{1,2}}){_ORD}\b|"
            rf"\bon the (?P<w>first|second|third)\b"
        ),
    ),
]
_TIME_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("time_clock", re.compile(r"\b(?P<h>\d{1,2})(?:[: ](?P<m>\d{2}))? ?(?P<ap>am|pm)\b")),
    ("time_clock", re.compile(r"\b(?P<h>\d{1,2}):(?P<m>\d{2})\b")),
    ("time_clock", re.compile(r"\b(?P<h>\d{1,2}) oclock\b")),
    ("time_named", re.compile(r"\b(?P<w>noon|midday|midnight|morning|afternoon|evening|tonight|night)\b")),
]
_NAMED_TIMES = {"noon": "12:00", "midday": "12:00", "midnight": "00:00", "tonight": "evening"}

_QUOTES = str.maketrans(
    {"’": "'", "‘": "'", "`": "'", "´": "'", "“": '"', "”": '"', "–": "-", "—": "-", "⁄": "/", "∕": "/"}
)
_KEEP_INSIDE_NUMBER = re.compile(r"(?<=\d)([.:/-])(?=\d)")
_PROTECTED = {".": "\x01", ":": "\x02", "-": "\x03", "/": "\x04"}
_PLACEHOLDER_BASE = 0xE000  # private-use characters: not \w, not \d, so no later rule can match inside one
# The placeholders' range: a character typed in it would stand for another span, so the input loses them.
_PRIVATE_USE = re.compile("[\ue000-\uf8ff]")
_PUNCTUATION = re.compile(r"[^\w\s$€£¥₹₩%\x01\x02\x03\x04\ue000-\uf8ff]|_")
# "$.50" and ".5 dollars" lost their point to the punctuation rule and became $50 and $5.
_LEADING_POINT = re.compile(r"(?<![\w.,])(?:\.(?=\d)|,(?=\d{1,2}(?!\d)))")
_NON_ASCII_DIGIT = re.compile(r"(?![0-9])\d")
_WORD = re.compile(r"\S+")


def minor_unit_exponent(currency: str) -> int:
    """Digits after the decimal point in ``currency`` (ISO 4217): JPY 0, USD 2, KWD 3."""
    try:
        return _EXPONENTS[currency.upper()]
    except KeyError:
        raise ValueError(f"unknown currency {currency!r}") from None


def is_known_currency(currency: object) -> bool:
    return isinstance(currency, str) and currency.upper() in _EXPONENTS


def format_money(amount_minor: int, currency: str) -> str:
    """ "$12.50", "¥5,000", "€50.00", "CHF 12.50": for replies that are read aloud."""
    exp = minor_unit_exponent(currency)
    sign = "-" if amount_minor < 0 else ""
    major, minor = divmod(abs(amount_minor), 10**exp)
    number = f"{major:,}" + (f".{minor:0{exp}d}" if exp else "")
    symbol = _SYMBOLS.get(currency.upper())
    return f"{sign}{symbol}{number}" if symbol else f"{sign}{currency.upper()} {number}"


@dataclass
class RuleApplied:
    rule: str
    before: str
    after: str


@dataclass
class Money:
    amount_minor: int
    currency: str
    text: str  # the span it came from, in the normalized (pre-canonical) text


@dataclass
class Normalized:
    original: str
    text: str
    money: Money | None
    date: dt.date | None
    time_of_day: str | None  # "morning" | "afternoon" | "evening" | "night" | "HH:MM"
    digits: list[str]
    rules: list[RuleApplied]
    amounts: list[Money] = field(default_factory=list)  # every amount, in order; ``money`` is the first
    invalid_date: str | None = None  # the words of a date said that does not exist: "february 30th"


def normalize(text: str, now: dt.datetime | None = None, default_currency: str = "USD") -> Normalized:
    """Normalizes one transcript; ``now`` anchors relative dates (defaults to the local clock)."""
    return _Normalizer(text, now or dt.datetime.now(), default_currency.upper()).run()


class _Normalizer:
    """One call's state: the text as it is rewritten, the rules log and the protected spans."""

    def __init__(self, text: str, now: dt.datetime, default_currency: str):
        self.original = text
        self.text = text
        self.today = now.date()
        self.default_currency = default_currency
        self.rules: list[RuleApplied] = []
        self.placeholders: list[str] = []  # index -> text restored at the end
        self.amounts: list[tuple[str, Money]] = []  # (placeholder, money)
        self.digits: list[str] = []
        self.invalid_date: str | None = None

    def run(self) -> Normalized:
        self._text_rule(
            "whitespace", lambda s: s
        )  # every rewrite collapses spaces; this logs the input's own
        self._text_rule("private_use", lambda s: _PRIVATE_USE.sub(" ", s))
        self._unreadable_numbers()  # before NFKC, which makes "½" 1⁄2 and "6²" 62
        self._text_rule("nfkc", lambda s: unicodedata.normalize("NFKC", s))
        self._text_rule("ascii_digits", lambda s: _NON_ASCII_DIGIT.sub(_ascii_digit, s))  # "٥٠" -> "50"
        self._text_rule("quotes", lambda s: s.translate(_QUOTES))
        self._text_rule("lowercase", str.lower)
        self._text_rule("fold_accents", _fold_latin_accents)
        self._text_rule("thousands_separator", lambda s: re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s))
        self._text_rule("decimal_comma", lambda s: re.sub(r"(?<=\d),(?=\d{1,2}(?!\d))", ".", s))
        self._text_rule("leading_point", lambda s: _LEADING_POINT.sub("0.", s))
        self._text_rule("minus_sign", _spell_minus)  # before punctuation drops the sign of "-$50"
        self._text_rule("punctuation", _strip_punctuation)
        self._text_rule("note_nickname", self._note_nickname)
        self._text_rule("article_number", lambda s: _ARTICLE_NUMBER.sub(r"one \1", s))
        self._text_rule("spoken_digits", self._spoken_digits)
        self._text_rule("number_words", lambda s: alpha2digit(s, "en"))
        self._text_rule("small_numbers", lambda s: _SMALL_NUMBERS.sub(lambda m: _SMALL_VALUES[m[1]], s))
        self._text_rule("number_scale", lambda s: _SCALE.sub(_scale, s))
        self._cue_digits()
        self._protect_spoken_digit_strings()
        self._money()
        date = self._date()
        time_of_day = self._time_of_day()
        text = self._restore(self.text)
        amounts = [m for _, m in sorted(self.amounts, key=lambda pm: self.text.index(pm[0]))]
        return Normalized(
            self.original,
            text,
            amounts[0] if amounts else None,
            date,
            time_of_day,
            self.digits,
            self.rules,
            amounts,
            self.invalid_date,
        )

    # --- text rewrites ------------------------------------------------------------------------------
    def _text_rule(self, name: str, fn: Callable[[str], str]) -> None:
        after = " ".join(fn(self.text).split())
        if after != self.text:
            self.rules.append(RuleApplied(name, self._restore(self.text), self._restore(after)))
            self.text = after

    def _placeholder(self, restored: str) -> str:
        self.placeholders.append(restored)
        return chr(_PLACEHOLDER_BASE + len(self.placeholders) - 1)

    def _restore(self, s: str) -> str:
        return "".join(
            self.placeholders[ord(c) - _PLACEHOLDER_BASE]
            if _PLACEHOLDER_BASE <= ord(c) < _PLACEHOLDER_BASE + len(self.placeholders)
            else c
            for c in s
        )

    def _unreadable_numbers(self) -> None:
        """A number written with a vulgar fraction, superscript, subscript or circled digit ("½", "6²", "①")
        is held in a placeholder, so it is no amount and no digits leak from it; any amount beside it is
        then refused too (``_money``)."""
        if self.text.isascii():
            return

        def held(m: re.Match) -> str:
            if not any(_is_compatibility_number(c) for c in m[0]):
                return m[0]
            self.rules.append(RuleApplied("unreadable_number", m[0], "not a plain number"))
            return self._placeholder(m[0])

        self.text = _WORD.sub(held, self.text)  # the whole word: "6²" must not leave its "6"

    def _note_nickname(self, s: str) -> str:
        code = self.default_currency.lower()
        unit = f" {code}" if code in _CURRENCY_NAMES else ""
        return _NOTE_NICKNAME.sub(lambda m: _NOTE_VALUES[m[1]] + unit, s)

    # --- digit strings --------------------------------------------------------------------------------
    def _spoken_digits(self, s: str) -> str:
        """Runs of digit words become one digit string: "four two oh one" -> "4201".

        A run needs three or more digits, or two with a zero ("oh one") or after a cue like "ending in",
        so "two hundred" or "one two" in a sentence are left to the number parser.
        """
        tokens = s.split()
        out: list[str] = []
        i = 0
        while i < len(tokens):
            j, digits = i, ""
            while j < len(tokens):
                tok = tokens[j]
                if tok in _REPEAT_WORDS and j + 1 < len(tokens) and tokens[j + 1] in _DIGIT_WORDS:
                    digits += _DIGIT_WORDS[tokens[j + 1]] * _REPEAT_WORDS[tok]
                    j += 2
                elif tok in _DIGIT_WORDS:
                    digits += _DIGIT_WORDS[tok]
                    j += 1
                else:
                    break
            run = tokens[i:j]
            real = [t for t in run if t not in ("oh", "o")]
            cue = any(t in _DIGIT_CUES for t in tokens[max(0, i - 3) : i])
            followed_by_scale = j < len(tokens) and tokens[j] in _SCALE_WORDS
            long_enough = len(digits) >= 3 or (len(digits) == 2 and (cue or "0" in digits))
            if real and long_enough and not followed_by_scale:
                out.append(digits)
                if len(digits) >= 3 or cue:  # "twelve oh five" is an amount, not a digit string
                    self.digits.append(digits)
                i = j
            else:
                out.append(tokens[i])
                i += 1
        return " ".join(out)

    def _cue_digits(self) -> None:
        """Digits after "ending in", "last four", "account number": joined and kept out of amounts."""

        def joined(m: re.Match) -> str:
            limit = (
                4 if m["cue"].startswith(("ending", "ends", "last")) else 19
            )  # a card fragment is 4 digits
            parts, rest = [], m["d"].split()
            while rest and len("".join(parts) + rest[0]) <= limit:
                parts.append(rest.pop(0))
            digits = "".join(parts)
            if len(digits) < 2:
                return m[0]
            if digits not in self.digits:
                self.digits.append(digits)
            self.rules.append(RuleApplied("digit_string", m[0], digits))
            tail = " " + " ".join(rest) if rest else ""
            return m["cue"] + self._placeholder(digits) + tail

        self.text = _CUE_DIGITS.sub(joined, self.text)

    def _protect_spoken_digit_strings(self) -> None:
        spoken = set(self.digits)
        self.text = " ".join(self._placeholder(t) if t in spoken else t for t in self.text.split())

    # --- money --------------------------------------------------------------------------------------
    def _money(self) -> None:
        mention = _CURRENCY_MENTION.search(self.text)
        context = self._currency_of(mention[0]) if mention else self.default_currency
        for m in _FRACTION_AMOUNT.finditer(self.text):
            self.rules.append(RuleApplied("money_rejected", self._restore(m[0]), "a fraction of an amount"))
        for rule, pattern in _MONEY_PATTERNS:
            self.text = pattern.sub(lambda m, rule=rule: self._money_match(rule, m, context), self.text)
        if any(r.rule in ("money_rejected", "unreadable_number") for r in self.rules):
            self._drop_amounts()
        elif not self.amounts and _MONEY_VERBS.search(self.text):
            self._bare_amount(context)

    def _drop_amounts(self) -> None:
        """One amount of the sentence was refused: the others are dropped too, so the policy asks "how
        much?". The refused one may be the amount meant ("50 dollars, no, 1.5 cents"), and "20 dollars and 1.5
        cents" must not pay the 20 dollars alone."""
        for placeholder, money in self.amounts:
            self.placeholders[ord(placeholder) - _PLACEHOLDER_BASE] = money.text
            self.rules.append(RuleApplied("money_dropped", money.text, "another amount was refused"))
        self.amounts = []

    def _currency_of(self, word: str) -> str:
        code = _SYMBOL_CURRENCY.get(word) or _CURRENCY_NAMES[word]
        if code == _DOLLAR:
            return self.default_currency if self.default_currency in _DOLLAR_FAMILY else "USD"
        return code

    def _money_match(self, rule: str, m: re.Match, context: str) -> str:
        groups = m.groupdict()
        if groups.get("sym"):
            currency = _SYMBOL_PREFIX.get(groups.get("pre") or "") or self._currency_of(groups["sym"])
        elif groups.get("cw"):
            currency = self._currency_of(groups["cw"])
        else:
            currency = _MINOR_NAMES[groups["mw"]] or context
        exp = minor_unit_exponent(currency)
        if rule == "money_pair":
            if exp == 3:
                return m[0]
            # Spoken "twelve fifty": 12.50 in a currency with cents, 1250 in one without (yen).
            value = (
                Decimal(f"{groups['major']}.{groups['minor']}")
                if exp == 2
                else Decimal(groups["major"] + groups["minor"])
            )
        elif rule == "money_minor_only":
            value = Decimal(groups["m"]).scaleb(-exp)
        else:
            value = Decimal(groups["n"])
            if groups.get("m"):
                minor = Decimal(groups["m"]).scaleb(-exp)
                if exp == 0 or minor >= 1 or value != value.to_integral_value():
                    return m[0]  # "5000 yen 50" or "12.5 dollars 30": not a major + minor amount
                value += minor
        return self._record_money(rule, m[0], value, currency, _negated(m)) or m[0]

    def _record_money(
        self, rule: str, span: str, value: Decimal, currency: str, negative: bool = False
    ) -> str | None:
        exp = minor_unit_exponent(currency)
        try:
            scaled = value.scaleb(exp)
        except InvalidOperation:
            return None
        if scaled != scaled.to_integral_value() or not 0 <= scaled < _MAX_MINOR:
            # More decimals than the currency has ("5000.5 yen"): refuse to guess; logged for the audit.
            self.rules.append(RuleApplied("money_rejected", span, f"{currency} has {exp} decimals"))
            return None
        # "minus fifty", "-$50": kept negative, so the policy refuses it with its reason instead of
        # quietly paying the absolute value.
        # The text keeps its "minus" before the amount.
        money = Money(-int(scaled) if negative else int(scaled), currency, self._restore(span))
        canonical = f"{_plain_amount(abs(money.amount_minor), exp)} {currency.lower()}"
        self.rules.append(RuleApplied(rule, money.text, canonical))
        placeholder = self._placeholder(canonical)
        self.amounts.append((placeholder, money))
        return placeholder

    def _bare_amount(self, currency: str) -> None:
        """A number with no currency in a sentence that moves money: the currency the sentence names
        elsewhere ("send 20 to bob in euros"), else the customer's default currency."""
        for pattern in (_BARE_PAIR, _BARE_NUM):
            for m in pattern.finditer(self.text):
                before = self.text[: m.start()].split()
                if before and before[-1] in _NOT_AMOUNT_BEFORE:
                    continue
                exp = minor_unit_exponent(currency)
                if pattern is _BARE_PAIR:
                    if exp == 3:
                        continue
                    value = (
                        Decimal(f"{m['major']}.{m['minor']}")
                        if exp == 2
                        else Decimal(m["major"] + m["minor"])
                    )
                else:
                    value = Decimal(m["n"])
                placeholder = self._record_money("money_default_currency", m[0], value, currency, _negated(m))
                if placeholder:
                    self.text = self.text[: m.start()] + placeholder + self.text[m.end() :]
                return

    # --- dates and times ------------------------------------------------------------------------------
    def _date(self) -> dt.date | None:
        for rule, pattern in _DATE_PATTERNS:
            for m in pattern.finditer(self.text):
                date = self._resolve_date(rule, m)
                if date is None and rule == "date_day_of_month" and not m[0].startswith("on"):
                    continue  # "the 45th" may be no date at all; "on the 45th" is one
                if date is None:
                    # Said, but no such day ("february 30th"): kept as said, so the policy asks for a date,
                    # never skipped (then "the 31st" inside "the 31st of april" paid on May 31, or nothing
                    # did and the payment was proposed for today).
                    self.invalid_date = self._restore(m[0])
                    self.rules.append(RuleApplied("date_invalid", self.invalid_date, "no such date"))
                    return None
                self.rules.append(RuleApplied(rule, m[0], date.isoformat()))
                return date
        return None

    def _resolve_date(self, rule: str, m: re.Match) -> dt.date | None:
        today = self.today
        if rule == "date_iso":
            try:
                return dt.date(int(m["y"]), int(m["mo"]), int(m["d"]))
            except ValueError:
                return None
        if rule == "date_relative":
            offsets = {"tomorrow": 1, "today": 0, "tonight": 0, "yesterday": -1}
            return today + dt.timedelta(days=2 if "after" in m[0] else offsets[m[0]])
        if rule == "date_in":
            n = {"a": 1, "an": 1, "one": 1, "two": 2}.get(m["n"]) or int(m["n"])
            # past a century the policy's "up to a year ahead" answers the same (and 3M days overflow a date)
            days = min(n * (7 if m["unit"].startswith("week") else 1), _MAX_DAYS_AHEAD)
            return today + dt.timedelta(days=days)
        if rule == "date_weekday":
            # "friday", "this friday" and "next friday" all mean the coming one, strictly after today.
            ahead = (_WEEKDAYS[m["wd"]] - today.weekday() - 1) % 7 + 1
            return today + dt.timedelta(days=ahead)
        if rule in ("date_month_day", "date_day_month"):
            return _next_month_day(today, _MONTHS[m["mon"]], int(m["d"]))
        if rule == "date_numeric":
            return None
        day = int(m["d"] or m["d2"] or 0) or _ORDINAL_WORDS.get(m["w"] or "", 0)
        return _next_day_of_month(today, day)

    def _time_of_day(self) -> str | None:
        for rule, pattern in _TIME_PATTERNS:
            m = pattern.search(self.text)
            if m is None:
                continue
            if rule == "time_named":
                value = _NAMED_TIMES.get(m["w"], m["w"])
            else:
                hour, minute = int(m["h"]), int(m.groupdict().get("m") or 0)
                ap = m.groupdict().get("ap")
                if ap:
                    if not 1 <= hour <= 12:
                        continue
                    hour = hour % 12 + (12 if ap == "pm" else 0)
                if hour > 23 or minute > 59:
                    continue
                value = f"{hour:02d}:{minute:02d}"
            self.rules.append(RuleApplied(rule, self._restore(m[0]), value))
            return value
        return None


def _is_compatibility_number(char: str) -> bool:
    """A number character that is no plain digit, or a symbol whose NFKC form holds digits: "½", "²", "₃",
    "①", "⒈", "㋀" (1月). A digit of any script ("٥", "５") is a digit: it is not one of these."""
    if char.isascii() or unicodedata.category(char) == "Nd":
        return False
    return unicodedata.category(char) == "No" or any(c.isdigit() for c in unicodedata.normalize("NFKC", char))


def _ascii_digit(m: re.Match) -> str:
    return str(unicodedata.decimal(m[0]))


def _fold_latin_accents(s: str) -> str:
    # Only Latin letters lose their marks ("josé" -> "jose"); kana and other scripts keep theirs, since
    # their combining marks change the letter, not an accent.
    decomposed = unicodedata.normalize("NFD", s)
    out = []
    for ch in decomposed:
        if unicodedata.combining(ch) and out and ord(out[-1]) < 0x250:
            continue
        out.append(ch)
    return unicodedata.normalize("NFC", "".join(out))


def _strip_punctuation(s: str) -> str:
    s = re.sub(r"(?<=\w)'(?=\w)", "", s)  # "what's" -> "whats", "o'brien" -> "obrien"
    s = s.replace("&", " and ")
    s = _KEEP_INSIDE_NUMBER.sub(lambda m: _PROTECTED[m[1]], s)  # 12.50, 3:30, 2025-05-08 survive
    s = _PUNCTUATION.sub(" ", s)
    for char, mark in _PROTECTED.items():
        s = s.replace(mark, char)
    return s


def _scale(m: re.Match) -> str:
    value = Decimal(m[1]) * _SCALE_VALUES[m[2]]
    return str(int(value)) if value == value.to_integral_value() else m[0]


# A minus sign written before an amount ("-$50", "-50", "$-50"), not one inside a word, date or number.
_MINUS_BEFORE_AMOUNT = re.compile(r"(?<![\w-])[-\u2212]\s?(?=[$£€¥]?\d)")
_MINUS_AFTER_SYMBOL = re.compile(r"([$£€¥])[-\u2212](?=\d)")


def _spell_minus(s: str) -> str:
    return _MINUS_BEFORE_AMOUNT.sub("minus ", _MINUS_AFTER_SYMBOL.sub(r"minus \1", s))


_NEGATION_BEFORE = re.compile(r"(?:\bminus|\bnegative|-)\s*$")


def _negated(m: re.Match) -> bool:
    """Whether the amount ``m`` matched is said or written negative: "minus 50", "negative 20", "-$50",
    "$-50"."""
    return bool(_NEGATION_BEFORE.search(m.string[max(0, m.start() - 12) : m.start()]))


def _plain_amount(amount_minor: int, exp: int) -> str:
    major, minor = divmod(amount_minor, 10**exp)
    return f"{major}.{minor:0{exp}d}" if exp else str(major)


def _next_month_day(today: dt.date, month: int, day: int) -> dt.date | None:
    """The next ``month``/``day`` (today included): February 29th in the next leap year; None when no year
    has that day ("february 30th")."""
    if not 1 <= day <= calendar.monthrange(2000, month)[1]:  # 2000 was a leap year: February has 29
        return None
    year = today.year
    while day > calendar.monthrange(year, month)[1] or dt.date(year, month, day) < today:
        year += 1
    return dt.date(year, month, day)


def _next_day_of_month(today: dt.date, day: int) -> dt.date | None:
    """The next date (today included) whose day of month is ``day``; months too short are skipped."""
    if not 1 <= day <= 31:
        return None
    year, month = today.year, today.month
    for _ in range(13):
        if day <= calendar.monthrange(year, month)[1] and dt.date(year, month, day) >= today:
            return dt.date(year, month, day)
        month += 1
        if month > 12:
            year, month = year + 1, 1
    return None
