"""Fast intent path over a table of written utterances: intent, entities, payee and when the LLM must look."""

from __future__ import annotations

import datetime as dt

import pytest

from g4serve_assistant.db import demo_db
from g4serve_assistant.intents import (
    AMBIGUOUS_PAYEE,
    CONFLICTING_INTENTS,
    INTENTS,
    LOW_CONFIDENCE,
    MISSING_AMOUNT,
    MISSING_PAYEE,
    MULTIPLE_AMOUNTS,
    NO_INTENT,
    PAYEE_NOT_FOUND,
    IntentClassifier,
    confirmation_of,
    resolve_payee,
)
from g4serve_assistant.normalize import normalize
from g4serve_assistant.payees import Candidate, PayeeIndex

NOW = dt.datetime(2025, 5, 7, 10, 0)  # a Wednesday


@pytest.fixture(scope="module")
def classifier() -> IntentClassifier:
    return IntentClassifier(PayeeIndex(demo_db()))


def classify(classifier: IntentClassifier, text: str):
    return classifier.classify(normalize(text, now=NOW))


# (utterance, intent, expected entities (a subset), needs_llm)
CONFIDENT = [
    # balance
    ("What's my balance?", "balance_inquiry", {}),
    ("how much money do I have in savings", "balance_inquiry", {"account": "sav-001"}),
    ("check my checking account balance", "balance_inquiry", {"account": "chk-001"}),
    ("what's the balance on my euro account", "balance_inquiry", {"account": "eur-001"}),
    ("am I overdrawn", "balance_inquiry", {}),
    ("available funds please", "balance_inquiry", {}),
    # transactions
    ("show me my recent transactions", "recent_transactions", {}),
    ("what were my last five transactions", "recent_transactions", {"limit": 5}),
    ("what did I spend at the coffee shop", "recent_transactions", {}),
    ("transaction history please", "recent_transactions", {}),
    ("list my latest purchases on savings", "recent_transactions", {"account": "sav-001"}),
    # transfers: spoken amounts, currencies, misspelled and phonetic names
    (
        "Send fifty dollars to John Smith",
        "transfer_money",
        {"amount_minor": 5000, "currency": "USD", "payee_id": "john_smith"},
    ),
    (
        "send $12.50 to catherine li tomorrow",
        "transfer_money",
        {"amount_minor": 1250, "currency": "USD", "payee_id": "catherine_li", "date": "2025-05-08"},
    ),
    (
        "transfer twelve dollars fifty to Katherine Lee",
        "transfer_money",
        {"amount_minor": 1250, "currency": "USD", "payee_id": "katherine_lee"},
    ),
    (
        "Please wire a hundred and five dollars to Priya Patel",
        "transfer_money",
        {"amount_minor": 10500, "currency": "USD", "payee_id": "priya_patel"},
    ),
    ("send prya patel twenty bucks", "transfer_money", {"amount_minor": 2000, "payee_id": "priya_patel"}),
    ("pay my friend john twenty dollars", "transfer_money", {"amount_minor": 2000, "payee_id": "john_smith"}),
    (
        "give tom wilson twenty quid",
        "transfer_money",
        {"amount_minor": 2000, "currency": "GBP", "payee_id": "tom_wilson"},
    ),
    (
        "transfer 5000 yen to yuki tanaka",
        "transfer_money",
        {"amount_minor": 5000, "currency": "JPY", "payee_id": "yuki_tanaka"},
    ),
    (
        "send five thousand yen to yuki",
        "transfer_money",
        {"amount_minor": 5000, "currency": "JPY", "payee_id": "yuki_tanaka"},
    ),
    (
        "send fifty euros to hans mueller next friday",
        "transfer_money",
        {"amount_minor": 5000, "currency": "EUR", "payee_id": "hans_muller", "date": "2025-05-09"},
    ),
    (
        "send ten thousand rupees to aisha kahn",
        "transfer_money",
        {"amount_minor": 1_000_000, "currency": "INR", "payee_id": "aisha_khan"},
    ),
    (
        "send $1,200 to my mom",
        "transfer_money",
        {"amount_minor": 120_000, "currency": "USD", "payee_id": "mary_johnson"},
    ),
    (
        "send twelve fifty to olga ivanova",
        "transfer_money",
        {"amount_minor": 1250, "currency": "USD", "payee_id": "olga_ivanova"},
    ),
    (
        "transfer 75.25 dollars to katherine lee",
        "transfer_money",
        {"amount_minor": 7525, "payee_id": "katherine_lee"},
    ),
    (
        "zelle shawn o brian forty dollars",
        "transfer_money",
        {"amount_minor": 4000, "payee_id": "sean_obrien"},
    ),
    (
        "send 30 euros to francois dubois",
        "transfer_money",
        {"amount_minor": 3000, "currency": "EUR", "payee_id": "francois_dubois"},
    ),
    (
        "send josé garcía 20€",
        "transfer_money",
        {"amount_minor": 2000, "currency": "EUR", "payee_id": "jose_garcia"},
    ),
    (
        "send my sister two hundred dollars on the 5th",
        "transfer_money",
        {"amount_minor": 20000, "payee_id": "joan_smith", "date": "2025-06-05"},
    ),
    ("move fifteen dollars to dad", "transfer_money", {"amount_minor": 1500, "payee_id": "robert_brown"}),
    ("send lee wei sixty dollars", "transfer_money", {"amount_minor": 6000, "payee_id": "li_wei"}),
    (
        "transfer one thousand two hundred thirty four dollars and fifty six cents to johnny",
        "transfer_money",
        {"amount_minor": 123_456, "currency": "USD", "payee_id": "john_smith"},
    ),
    (
        "send ninety nine cents to tom wilson",
        "transfer_money",
        {"amount_minor": 99, "currency": "USD", "payee_id": "tom_wilson"},
    ),
    ("send twenty thousand won to yuki tanaka", "transfer_money", {"amount_minor": 20000, "currency": "KRW"}),
    (
        "send two point five kuwaiti dinars to ahmed hassan",
        "transfer_money",
        {"amount_minor": 2500, "currency": "KWD", "payee_id": "ahmed_hassan"},
    ),
    (
        "send 40 to olga",
        "transfer_money",
        {"amount_minor": 4000, "currency": "USD", "payee_id": "olga_ivanova"},
    ),
    # bill payments
    (
        "pay my electric bill of eighty four dollars and twenty cents",
        "bill_payment",
        {"amount_minor": 8420, "currency": "USD", "payee_id": "city_electric"},
    ),
    ("pay the water bill 45 dollars", "bill_payment", {"amount_minor": 4500, "payee_id": "metro_water"}),
    (
        "pay fifty nine ninety nine to northside internet on the 5th",
        "bill_payment",
        {"amount_minor": 5999, "payee_id": "northside_internet", "date": "2025-06-05"},
    ),
    ("pay mike rosoft twelve dollars", "bill_payment", {"amount_minor": 1200, "payee_id": "microsoft"}),
    (
        "pay 120 dollars to harbour insurance",
        "bill_payment",
        {"amount_minor": 12000, "payee_id": "harbor_insurance"},
    ),
    (
        "pay my credit card bill 300 dollars",
        "bill_payment",
        {"amount_minor": 30000, "payee_id": "platinum_card"},
    ),
    ("pay stream flicks 15.99", "bill_payment", {"amount_minor": 1599, "payee_id": "streamflix"}),
    (
        "pay my rent 1500 dollars on the first",
        "transfer_money",  # the landlord is a person: a transfer
        {"amount_minor": 150_000, "payee_id": "maria_gonzalez", "date": "2025-06-01"},
    ),
    # cards
    ("lock my card", "card_lock", {}),
    ("freeze my debit card", "card_lock", {"card": "card-debit"}),
    ("I lost my wallet", "card_lock", {}),
    ("my credit card was stolen", "card_lock", {"card": "card-credit"}),
    ("lock the card ending in four two oh one", "card_lock", {"card": "card-debit"}),
    ("block the card ending in 8812", "card_lock", {"card": "card-credit"}),
    ("unlock my card", "card_unlock", {}),
    ("unfreeze my credit card", "card_unlock", {"card": "card-credit"}),
    ("I found my card, please turn it back on", "card_unlock", {}),
    # payee lookups
    ("is John Smith one of my payees", "recipient_lookup", {"payee_id": "john_smith"}),
    ("do I have Katherine Lee as a recipient", "recipient_lookup", {"payee_id": "katherine_lee"}),
    ("list my payees", "recipient_lookup", {}),
    ("find stephen clark", "recipient_lookup", {}),  # two close matches: the reply lists both
    ("is gran one of my payees", "recipient_lookup", {"payee_name": "gran"}),
    # handoff
    ("I want to talk to a human", "human_handoff", {}),
    ("let me speak to an agent", "human_handoff", {}),
    ("customer service please", "human_handoff", {}),
    # questions for the knowledge base
    ("where is the nearest ATM", "qna", {}),
    ("what are your opening hours on saturday", "qna", {}),
    ("what's the fee for an international wire", "qna", {}),
    ("how do I send money abroad", "qna", {}),
    ("what is the interest rate on savings", "qna", {}),
    ("what's the routing number", "qna", {}),
]

# (utterance, intent, reason code the result must name)
UNSURE = [
    ("send jon smyth fifty bucks", "transfer_money", AMBIGUOUS_PAYEE),  # John Smith, Jon Smythe, Joan Smith
    ("pay catherine twenty dollars", "transfer_money", AMBIGUOUS_PAYEE),  # Catherine Li or Katherine Lee
    ("send steven clarke 10 dollars", "transfer_money", AMBIGUOUS_PAYEE),  # Steven Clark or Stephen Clarke
    (
        "transfer 75.25 dollars to kathryn lee",
        "transfer_money",
        AMBIGUOUS_PAYEE,
    ),  # heard as either Kat(h)erine
    ("send 50 dollars to my friend", "transfer_money", AMBIGUOUS_PAYEE),  # eight friends
    ("transfer 100 dollars", "transfer_money", MISSING_PAYEE),
    ("send 20 dollars to zeb quarterman", "transfer_money", PAYEE_NOT_FOUND),
    ("check my balance and lock my card", "card_lock", CONFLICTING_INTENTS),
    ("fifty dollars", "transfer_money", LOW_CONFIDENCE),  # a fragment: an answer to "how much?"
    ("hmm what about the thing", "unknown", NO_INTENT),
    ("send 20 euros to hans and 30 dollars to tom", "transfer_money", MULTIPLE_AMOUNTS),
]


@pytest.mark.parametrize(("text", "intent", "entities"), CONFIDENT, ids=[c[0] for c in CONFIDENT])
def test_confident_fast_path(classifier, text, intent, entities):
    r = classify(classifier, text)
    assert r.intent == intent, (r.intent, r.scores, r.rules)
    assert not r.needs_llm, r.ambiguity_reason
    assert r.ambiguity_reason is None
    assert r.confidence >= classifier.threshold
    for key, value in entities.items():
        assert r.entities.get(key) == value, (key, r.entities)
    if "payee_id" in entities:
        assert r.candidates[0].payee_id == entities["payee_id"]
    if intent in ("transfer_money", "bill_payment"):
        assert {"amount_minor", "currency", "payee_id", "payee_name"} <= r.entities.keys()


@pytest.mark.parametrize(("text", "intent", "reason"), UNSURE, ids=[c[0] for c in UNSURE])
def test_unsure_goes_to_llm(classifier, text, intent, reason):
    r = classify(classifier, text)
    assert r.intent == intent, (r.intent, r.scores)
    assert r.needs_llm
    assert reason in r.ambiguity_reason
    if reason == AMBIGUOUS_PAYEE:
        assert "payee_id" not in r.entities  # never a guess between close names
        assert len(r.candidates) >= 2


@pytest.mark.parametrize(
    ("text", "intent", "payee_id"),
    [
        ("I want to send money to Priya", "transfer_money", "priya_patel"),
        ("pay my phone bill", "bill_payment", None),
    ],
)
def test_missing_amount_is_asked_not_sent_to_the_llm(classifier, text, intent, payee_id):
    """No model can supply an amount nobody said: the policy asks "how much?" without a Gemma call."""
    r = classify(classifier, text)
    assert r.intent == intent, (r.intent, r.scores)
    assert not r.needs_llm
    assert MISSING_AMOUNT in r.ambiguity_reason
    assert "amount_minor" not in r.entities
    if payee_id:
        assert r.entities["payee_id"] == payee_id


def test_table_is_large_and_varied():
    assert len(CONFIDENT) + len(UNSURE) >= 60
    intents = {c[1] for c in CONFIDENT + UNSURE}
    assert intents == set(INTENTS)
    currencies = {c[2].get("currency") for c in CONFIDENT} - {None}
    assert {"USD", "EUR", "GBP", "JPY", "INR", "KRW", "KWD"} <= currencies


def test_ambiguous_payee_names_every_close_candidate(classifier):
    r = classify(classifier, "send jon smyth fifty bucks")
    assert {c.payee_id for c in r.candidates[:3]} == {"john_smith", "jon_smythe", "joan_smith"}
    for name in ("John Smith", "Jon Smythe", "Joan Smith"):
        assert name in r.ambiguity_reason
    assert r.entities["amount_minor"] == 5000  # the amount is still known: only the payee is not


def test_exact_name_resolves_despite_homophones(classifier):
    r = classify(classifier, "send ten dollars to jon smythe")
    assert r.entities["payee_id"] == "jon_smythe" and not r.needs_llm


def test_confirmations_are_recognized_before_intents(classifier):
    yes = classify(classifier, "Yes please, go ahead")
    assert (yes.intent, yes.needs_llm, yes.entities) == ("unknown", False, {"confirmation": True})
    no = classify(classifier, "no")
    assert no.entities == {"confirmation": False} and not no.needs_llm


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("yes", True),
        ("Yeah.", True),
        ("yes please", True),
        ("ok", True),
        ("confirm", True),
        ("go ahead", True),
        ("do it", True),
        ("that's right, send it", True),
        ("sure", True),
        ("no", False),
        ("nope", False),
        ("cancel", False),
        ("cancel it", False),
        ("don't do that", False),
        ("never mind", False),
        ("no, send it to joan instead", False),
        ("stop", False),
        ("yes no", None),
        ("cancel my card", None),
        ("yes but make it sixty", None),
        ("what's my balance", None),
        ("", None),
        ("lock my card", None),
        ("send fifty dollars to john", None),
    ],
)
def test_confirmation_of(text, expected):
    assert confirmation_of(text) is expected


def test_results_are_well_formed(classifier):
    for text, *_ in CONFIDENT + UNSURE:
        r = classify(classifier, text)
        assert r.intent in INTENTS
        assert 0.0 <= r.confidence <= 1.0
        assert all(0.0 <= c.score <= 100.0 for c in r.candidates)
        assert [c.score for c in r.candidates] == sorted((c.score for c in r.candidates), reverse=True)
        assert r.rules or r.intent == "unknown"


def test_rules_name_the_patterns_that_fired(classifier):
    r = classify(classifier, "send fifty dollars to John Smith")
    assert "transfer_money:send_verb" in r.rules
    assert "transfer_money:amount" in r.rules and "transfer_money:payee_person" in r.rules


def test_payee_kind_settles_transfer_or_bill(classifier):
    assert classify(classifier, "pay city electric 80 dollars").intent == "bill_payment"
    assert classify(classifier, "pay priya patel 80 dollars").intent == "transfer_money"


def test_question_about_a_procedure_is_not_an_action(classifier):
    r = classify(classifier, "how do I lock my card")
    assert r.intent == "qna" and not r.needs_llm


@pytest.mark.parametrize(
    ("text", "intent", "entities"),
    [
        # A phrasing that rules out what its words would also say.
        ("can you transfer me to the fraud team", "human_handoff", {}),
        ("I want to speak to someone about a transfer", "human_handoff", {}),
        ("take the block off my card please", "card_unlock", {}),
        ("remove the lock on my credit card", "card_unlock", {"card": "card-credit"}),
        ("when did I last pay the electric bill", "recent_transactions", {}),
        ("did my rent go through", "recent_transactions", {}),
        ("do I have enough to pay priya 50 dollars", "balance_inquiry", {}),
        ("who can I send money to", "recipient_lookup", {}),
        ("is city electric saved as a payee", "recipient_lookup", {"payee_id": "city_electric"}),
        ("I can't find my card anywhere", "card_lock", {}),  # lost, not a payee search
        # New rules that must not take what is not theirs.
        ("how much is left on my credit card", "balance_inquiry", {}),
        ("can I come in to the branch tomorrow", "qna", {}),
        ("what's the interest rate on my savings account", "qna", {}),
        ("send 50 dollars to john smith for the phone bill", "transfer_money", {"payee_id": "john_smith"}),
        # British and Canadian words for the accounts.
        ("what's in my current account", "balance_inquiry", {"account": "chk-001"}),
        ("what's the balance of my chequing account", "balance_inquiry", {"account": "chk-001"}),
        ("my purse got nicked, put a stop on my cards", "card_lock", {}),
    ],
)
def test_phrasings_decide_their_reading(classifier, text, intent, entities):
    r = classify(classifier, text)
    assert r.intent == intent, (r.intent, r.scores, r.rules)
    assert not r.needs_llm, r.ambiguity_reason
    for key, value in entities.items():
        assert r.entities.get(key) == value, (key, r.entities)


def test_chatter_alone_is_no_question_for_the_bank(classifier):
    """A "what's the ..." with nothing about the bank in it is not sent to the knowledge base."""
    for text in ("what's the weather like today", "what's the score in the game"):
        r = classify(classifier, text)
        assert r.intent == "unknown" and r.needs_llm, (text, r.scores)


def test_resolve_payee_rules():
    def cand(pid: str, score: float) -> Candidate:
        return Candidate(pid, pid, "friend", "person", score, False)

    assert resolve_payee([]) == (None, None)
    assert resolve_payee([cand("a", 70.0)]) == (None, PAYEE_NOT_FOUND)
    assert resolve_payee([cand("a", 95.0), cand("b", 80.0)])[0].payee_id == "a"
    payee, reason = resolve_payee([cand("a", 95.0), cand("b", 90.0)])
    assert payee is None and reason.startswith(AMBIGUOUS_PAYEE)
    assert resolve_payee([cand("a", 100.0), cand("b", 95.0)])[0].payee_id == "a"  # the sole exact name
    assert resolve_payee([cand("a", 100.0), cand("b", 100.0)])[0] is None  # two payees, one name


def test_classifier_sees_new_payees(tmp_path):
    db = demo_db()
    classifier = IntentClassifier(PayeeIndex(db))
    assert classify(classifier, "send 20 dollars to zeb quarterman").needs_llm
    csv = tmp_path / "more.csv"
    csv.write_text("payee_id,display_name,relationship\nzeb,Zeb Quarterman,friend\n")
    db.import_payees_csv(csv)
    r = classify(classifier, "send 20 dollars to zeb quarterman")
    assert r.entities["payee_id"] == "zeb" and not r.needs_llm
