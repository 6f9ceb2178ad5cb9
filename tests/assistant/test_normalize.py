"""Deterministic normalization: spoken and written amounts in minor units, digit strings, dates against a
fixed clock, casing and width, and the audit log of every rule applied."""

from __future__ import annotations

import datetime as dt

import pytest

from g4serve_assistant.normalize import format_money, minor_unit_exponent, normalize

NOW = dt.datetime(2025, 5, 7, 10, 0)  # a Wednesday


@pytest.mark.parametrize(
    ("text", "amount_minor", "currency"),
    [
        ("send five thousand yen to bob", 5000, "JPY"),
        ("twelve dollars fifty", 1250, "USD"),
        ("twelve dollars and fifty cents", 1250, "USD"),
        ("$12.50", 1250, "USD"),
        ("send john twelve fifty", 1250, "USD"),  # a bare amount in a money sentence: the default currency
        ("twelve fifty dollars", 1250, "USD"),
        ("twelve oh five dollars", 1205, "USD"),
        ("fifty euros", 5000, "EUR"),
        ("€50", 5000, "EUR"),
        ("12,50 €", 1250, "EUR"),  # decimal comma
        ("two hundred pounds", 20000, "GBP"),
        ("twenty quid", 2000, "GBP"),
        ("£7.99", 799, "GBP"),
        ("fifty p", 50, "GBP"),
        ("ten thousand rupees", 1_000_000, "INR"),
        ("₹250", 25000, "INR"),
        ("twenty thousand won", 20000, "KRW"),
        ("five kuwaiti dinars", 5000, "KWD"),
        ("1.5 bahraini dinars", 1500, "BHD"),
        ("a hundred and five dollars", 10500, "USD"),
        ("one hundred and five dollars", 10500, "USD"),
        ("$1,200", 120_000, "USD"),
        ("$1,234,567.89", 123_456_789, "USD"),
        ("a thousand bucks", 100_000, "USD"),
        ("5k dollars", 500_000, "USD"),
        ("send two grand", 200_000, "USD"),
        ("fifty cents", 50, "USD"),
        ("ninety nine cents", 99, "USD"),
        ("two dollars", 200, "USD"),
        ("one dollar", 100, "USD"),
        ("transfer one thousand two hundred thirty four dollars and fifty six cents", 123_456, "USD"),
        ("seventy five canadian dollars", 7500, "CAD"),
        ("usd 40", 4000, "USD"),
        ("40 usd", 4000, "USD"),
        ("５０ dollars", 5000, "USD"),  # full-width digits
        ("＄１２.５０", 1250, "USD"),
        ("twelve fifty yen", 1250, "JPY"),  # no minor unit: twelve fifty is 1250
    ],
)
def test_amounts(text, amount_minor, currency):
    n = normalize(text, now=NOW)
    assert n.money is not None, n.rules
    assert (n.money.amount_minor, n.money.currency) == (amount_minor, currency)


@pytest.mark.parametrize(
    "text",
    [
        "what's my balance",
        "show my last 3 transactions",
        "lock the card ending in 4201",
        "pay my bill on the 5th",
        "in 2 days at 3 pm",
        "call me at 5",
        "five thousand",
        "account number one two three four five six",
    ],
)
def test_no_amount_without_money_words(text):
    assert normalize(text, now=NOW).money is None


def test_default_currency_is_injectable():
    assert normalize("send 20 to bob", default_currency="EUR").money.currency == "EUR"
    # "dollars" means the customer's own dollar when it is one, else US dollars.
    assert normalize("send 20 dollars to bob", default_currency="CAD").money.currency == "CAD"
    assert normalize("send 20 dollars to bob", default_currency="EUR").money.currency == "USD"
    assert normalize("send 500 to bob", default_currency="JPY").money.amount_minor == 500
    assert normalize("send 20 to bob in euros").money.currency == "EUR"  # the sentence names it


@pytest.mark.parametrize(
    ("text", "currency", "amount_minor", "code"),
    [
        ("send sam a tenner", "GBP", 1000, "GBP"),
        ("move a fiver to emma", "GBP", 500, "GBP"),
        ("give him a fiver", "USD", 500, "USD"),  # a five-dollar bill in the US
        ("lend me a tenner", "CAD", 1000, "CAD"),
        ("pay a tenner to bob", "NZD", 1000, "NZD"),  # a currency with no spoken name: the default
    ],
)
def test_note_nicknames_are_amounts_in_the_customers_currency(text, currency, amount_minor, code):
    n = normalize(text, now=NOW, default_currency=currency)
    assert (n.money.amount_minor, n.money.currency) == (amount_minor, code)
    assert any(r.rule == "note_nickname" for r in n.rules)
    assert normalize("the fiverr website", now=NOW, default_currency=currency).money is None


def test_more_decimals_than_the_currency_has_is_refused_and_logged():
    n = normalize("send 5000.5 yen to yuki", now=NOW)
    assert n.money is None
    assert [r.rule for r in n.rules if r.rule == "money_rejected"] == ["money_rejected"]
    assert normalize("send $12.505 to bob").money is None


def test_canonical_text_and_money_span():
    n = normalize("Send $1,200.50 to Jon Smyth tomorrow!", now=NOW)
    assert n.text == "send 1200.50 usd to jon smyth tomorrow"
    assert n.money.text == "$1200.50"
    assert n.original == "Send $1,200.50 to Jon Smyth tomorrow!"


def test_every_amount_is_kept_in_order():
    n = normalize("send 20 euros to hans and 30 dollars to john", now=NOW)
    assert [(m.amount_minor, m.currency) for m in n.amounts] == [(2000, "EUR"), (3000, "USD")]
    assert n.money == n.amounts[0]


@pytest.mark.parametrize(
    ("text", "digits"),
    [
        ("card ending in four two oh one", ["4201"]),
        ("card ending in four two zero one", ["4201"]),
        ("the one ending in 42 01", ["4201"]),
        ("last four digits are eight eight one two", ["8812"]),
        ("ending with double four one two", ["4412"]),
        ("account number one two three four five six", ["123456"]),
        ("my pin is nine nine one", ["991"]),
        ("send twelve oh five dollars", []),  # an amount, not a digit string
        ("two hundred dollars", []),
    ],
)
def test_digit_strings(text, digits):
    n = normalize(text, now=NOW)
    assert n.digits == digits
    for d in digits:
        assert d in n.text.split()


def test_digit_strings_are_not_amounts():
    n = normalize("pay 20 dollars with the card ending in four two oh one", now=NOW)
    assert n.digits == ["4201"]
    assert (n.money.amount_minor, n.money.currency) == (2000, "USD")


@pytest.mark.parametrize(
    ("text", "date"),
    [
        ("today", dt.date(2025, 5, 7)),
        ("tomorrow morning", dt.date(2025, 5, 8)),
        ("the day after tomorrow", dt.date(2025, 5, 9)),
        ("yesterday", dt.date(2025, 5, 6)),
        ("next friday", dt.date(2025, 5, 9)),
        ("on friday", dt.date(2025, 5, 9)),
        ("this wednesday", dt.date(2025, 5, 14)),  # strictly after today
        ("on monday", dt.date(2025, 5, 12)),
        ("on the 5th", dt.date(2025, 6, 5)),  # the 5th has passed this month
        ("on the seventh", dt.date(2025, 5, 7)),  # today counts
        ("on the twentieth", dt.date(2025, 5, 20)),
        ("on the first", dt.date(2025, 6, 1)),
        ("on the 31st", dt.date(2025, 5, 31)),
        ("june third", dt.date(2025, 6, 3)),
        ("the 3rd of june", dt.date(2025, 6, 3)),
        ("march 5th", dt.date(2026, 3, 5)),  # already past this year
        ("in two days", dt.date(2025, 5, 9)),
        ("in a week", dt.date(2025, 5, 14)),
        ("in 3 weeks", dt.date(2025, 5, 28)),
        # past a century it stops there: the policy refuses more than a year ahead (3M days overflowed a 500)
        ("in 99999999999 days", dt.date(2025, 5, 7) + dt.timedelta(days=36_600)),
        ("2025-12-24", dt.date(2025, 12, 24)),
        ("send 50 dollars", None),
    ],
)
def test_dates_against_a_fixed_now(text, date):
    assert normalize(text, now=NOW).date == date


def test_day_of_month_skips_short_months():
    assert normalize("on the 31st", now=dt.datetime(2025, 2, 10)).date == dt.date(2025, 3, 31)
    assert normalize("on the 30th", now=dt.datetime(2025, 12, 31)).date == dt.date(2026, 1, 30)


@pytest.mark.parametrize(
    ("text", "time_of_day"),
    [
        ("tomorrow morning", "morning"),
        ("this afternoon", "afternoon"),
        ("tonight", "evening"),
        ("at 3 pm", "15:00"),
        ("at three thirty pm", "15:30"),
        ("at 3:30 pm", "15:30"),
        ("12 am", "00:00"),
        ("at 9 am tomorrow", "09:00"),
        ("at noon", "12:00"),
        ("at 17:45", "17:45"),
        ("at two pm", "14:00"),
        ("send 50 dollars", None),
    ],
)
def test_time_of_day(text, time_of_day):
    assert normalize(text, now=NOW).time_of_day == time_of_day


def test_tonight_is_today_in_the_evening():
    n = normalize("tonight", now=NOW)
    assert (n.date, n.time_of_day) == (dt.date(2025, 5, 7), "evening")


def test_casing_width_and_punctuation():
    n = normalize("  What’s   MY Balance?? ", now=NOW)
    assert n.text == "whats my balance"
    assert normalize("ＳＥＮＤ ５０ ＥＵＲＯＳ").text == "send 50.00 eur"
    assert normalize("Sean O'Brien & José García").text == "sean obrien and jose garcia"
    assert normalize("日本の銀行").text == "日本の銀行"  # other scripts pass through
    assert normalize("").text == "" and normalize("").rules == []


def test_every_rule_is_logged_with_before_and_after():
    n = normalize("Send ＄１２.５０ to the card ending in four two oh one Tomorrow at 3 PM", now=NOW)
    names = [r.rule for r in n.rules]
    for rule in (
        "nfkc",
        "lowercase",
        "spoken_digits",
        "digit_string",
        "money_symbol",
        "date_relative",
        "time_clock",
    ):
        assert rule in names, names
    assert names.index("nfkc") < names.index("lowercase") < names.index("money_symbol")
    by_name = {r.rule: r for r in n.rules}
    assert by_name["nfkc"].after.startswith("Send $12.50")
    assert (by_name["money_symbol"].before, by_name["money_symbol"].after) == ("$12.50", "12.50 usd")
    assert (by_name["date_relative"].before, by_name["date_relative"].after) == ("tomorrow", "2025-05-08")
    assert by_name["digit_string"].after == "4201"
    assert by_name["time_clock"].after == "15:00"
    # Rewrites chain: each rule's "before" is the previous rewrite's "after".
    rewrites = [
        r
        for r in n.rules
        if r.rule in ("whitespace", "nfkc", "quotes", "lowercase", "punctuation", "spoken_digits")
    ]
    for a, b in zip(rewrites, rewrites[1:], strict=False):
        assert a.after == b.before


def test_nothing_to_do_logs_nothing():
    assert normalize("whats my balance", now=NOW).rules == []


def test_deterministic():
    text = "send twelve fifty to jon smyth next friday at 3 pm"
    assert normalize(text, now=NOW) == normalize(text, now=NOW)


@pytest.mark.parametrize(
    ("currency", "exponent"),
    [
        ("USD", 2),
        ("EUR", 2),
        ("GBP", 2),
        ("INR", 2),
        ("JPY", 0),
        ("KRW", 0),
        ("KWD", 3),
        ("BHD", 3),
        ("jpy", 0),
    ],
)
def test_minor_unit_exponent(currency, exponent):
    assert minor_unit_exponent(currency) == exponent


def test_unknown_currency_raises():
    with pytest.raises(ValueError, match="XYZ"):
        minor_unit_exponent("XYZ")


@pytest.mark.parametrize(
    ("amount_minor", "currency", "text"),
    [
        (1250, "USD", "$12.50"),
        (123_456, "USD", "$1,234.56"),
        (5000, "JPY", "¥5,000"),
        (5000, "EUR", "€50.00"),
        (5, "GBP", "£0.05"),
        (10_000_000, "INR", "₹100,000.00"),
        (1500, "KWD", "KWD 1.500"),
        (1250, "CHF", "CHF 12.50"),
        (-300, "USD", "-$3.00"),
        (0, "USD", "$0.00"),
        (1_000_000, "KRW", "₩1,000,000"),
    ],
)
def test_format_money(amount_minor, currency, text):
    assert format_money(amount_minor, currency) == text
