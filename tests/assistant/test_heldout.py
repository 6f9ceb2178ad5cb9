"""The held-out set (tests/assistant/data/heldout*.jsonl) as a regression guard on the fast path, and issue
20's lookup repros. Customers are static objects built from the data file (payees, version, cards,
accounts): no database, so the lookup and intents are tested alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from g4serve_assistant.intents import (
    AMBIGUOUS_PAYEE,
    INTENTS,
    MISSING_AMOUNT,
    PAYEE_MARGIN,
    close_candidates,
    resolve_payee,
)
from g4serve_assistant.payees import Candidate
from g4serve_assistant.policy import Policy, SessionState

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load_bench():
    spec = importlib.util.spec_from_file_location("assistant_heldout", BENCH / "assistant_heldout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("assistant_heldout", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


heldout_bench = _load_bench()

# Floors a little under what was measured (bench/assistant_heldout.py, docs/assistant.md "Held-out set"):
# about one or two cases of each intent's share, so a rule change that breaks phrasings fails here.
OVERALL_FLOOR = 0.97  # measured 0.996 (246 of 247)
TO_GEMMA_CEILING = 0.14  # measured 0.117: the asks, the unknown payees and the out-of-scope turns
INTENT_FLOORS = {
    "balance_inquiry": 0.95,  # measured 1.0 of 28
    "recent_transactions": 0.95,  # 1.0 of 24
    "transfer_money": 0.96,  # 1.0 of 54
    "card_lock": 0.95,  # 1.0 of 22
    "card_unlock": 0.92,  # 1.0 of 13
    "bill_payment": 0.94,  # 0.974 of 38
    "recipient_lookup": 0.93,  # 1.0 of 16
    "human_handoff": 0.93,  # 1.0 of 16
    "qna": 0.95,  # 1.0 of 24
    "unknown": 0.9,  # 1.0 of 12
}
# heldout_fresh.jsonl was written before any rule change and not tuned on: its figure is the honest one.
FRESH_FLOOR = 0.8  # measured 0.833 (55 of 66)


@pytest.fixture(scope="module")
def heldout():
    return heldout_bench.load()


def classify(heldout, customer: str, text: str):
    return heldout.classify({"customer": customer, "text": text})


def test_the_set_is_large_varied_and_well_labelled(heldout):
    cases = heldout.cases
    assert len(cases) >= 200
    assert len({c["id"] for c in cases}) == len(cases)
    assert {c["intent"] for c in cases} == set(INTENTS)
    assert len(heldout.customers) >= 4
    for case in cases:
        customer = heldout.customers[case["customer"]]
        payees = {p.payee_id for p in customer.payees()}
        named = [case.get("payee")] + case.get("ask", []) + case.get("ask_may", [])
        assert {p for p in named if p} <= payees, case["id"]
        if case["intent"] in ("transfer_money", "bill_payment"):
            assert "amount_minor" in case and ("payee" in case or "ask" in case), case["id"]
        if case.get("amount_minor") is not None:
            assert case["currency"], case["id"]
    asks = [c for c in cases if "ask" in c]
    assert len(asks) >= 10 and all(len(c["ask"]) >= 2 for c in asks)


def test_heldout_accuracy_floors(heldout):
    report = heldout_bench.run(heldout, repeats=1)
    misses = "\n".join(f"{m['id']} {m['text']!r}: {m['got']}" for m in report["confusions"])
    assert report["accuracy"] >= OVERALL_FLOOR, misses
    assert report["to_gemma"] <= TO_GEMMA_CEILING, misses
    for intent, floor in INTENT_FLOORS.items():
        assert report["per_intent"][intent]["accuracy"] >= floor, (intent, misses)


def test_fresh_heldout_accuracy_floor():
    report = heldout_bench.run(heldout_bench.load(cases="heldout_fresh.jsonl"), repeats=1)
    assert report["cases"] >= 60
    assert report["accuracy"] >= FRESH_FLOOR, report["confusions"]


def test_mistakes_catch_every_kind_of_wrong_answer(heldout):
    """The scorer itself: a right answer scores clean, each kind of wrong one is named."""
    case = {"customer": "olivia", "text": "send emma twenty five pounds", "intent": "transfer_money"}
    right = heldout.classify(case)
    assert (
        heldout_bench.mistakes(
            {**case, "payee": "emma_jones", "amount_minor": 2500, "currency": "GBP"}, right
        )
        == []
    )
    assert heldout_bench.mistakes({**case, "payee": "sam_patel", "amount_minor": 2500}, right)
    assert heldout_bench.mistakes({**case, "payee": "emma_jones", "amount_minor": 2000}, right)
    assert heldout_bench.mistakes({**case, "payee": "emma_jones", "currency": "USD"}, right)
    assert heldout_bench.mistakes({**case, "ask": ["emma_jones", "margaret_jones"]}, right)
    assert heldout_bench.mistakes({**case, "intent": "bill_payment", "payee": "emma_jones"}, right)
    asked = heldout.classify({"customer": "olivia", "text": "pay the water bill"})
    assert (
        heldout_bench.mistakes(
            {**case, "intent": "bill_payment", "ask": ["metro_water", "thames_water"]}, asked
        )
        == []
    )
    assert heldout_bench.mistakes(
        {**case, "intent": "bill_payment", "ask": ["metro_water"]}, asked
    )  # one too many
    assert heldout_bench.mistakes({**case, "intent": "bill_payment", "payee": "metro_water"}, asked)


# --- issue 20's repros ---------------------------------------------------------------------------------


def test_the_name_said_in_full_beats_an_alias_that_matches_part_of_it(heldout):
    """Olivia holds Thames Water and Metro Water (alias "water"): "thames water" is Thames Water."""
    r = classify(heldout, "olivia", "pay my thames water bill")
    assert r.candidates[0].payee_id == "thames_water" and r.candidates[0].score == 100.0
    assert all(c.score < r.candidates[0].score - PAYEE_MARGIN for c in r.candidates[1:])
    assert r.intent == "bill_payment" and r.entities["payee_id"] == "thames_water"
    assert [c.payee_id for c in close_candidates(r.candidates)] == ["thames_water"]
    r = classify(heldout, "olivia", "pay thames water thirty eight pounds fifty")
    assert (r.intent, r.entities["payee_id"], r.entities["amount_minor"], r.entities["currency"]) == (
        "bill_payment",
        "thames_water",
        3850,
        "GBP",
    )
    assert not r.needs_llm


@pytest.mark.parametrize(
    ("customer", "text", "close"),
    [
        ("olivia", "pay the water bill", {"metro_water", "thames_water"}),  # "water" fits both
        ("marcus", "send fifty dollars to sarah", {"sarah_connor", "sara_conner"}),  # heard alike
        ("marcus", "send michael brown forty dollars", {"mike_brown", "michael_braun"}),  # nickname vs sound
        ("wei", "send chris twenty dollars", {"chris_taylor", "kris_tailor"}),
        ("alex", "give catherine twenty dollars", {"catherine_li", "katherine_lee"}),
    ],
)
def test_close_candidates_are_asked_about_naming_each(heldout, customer, text, close):
    r = classify(heldout, customer, text)
    assert "payee_id" not in r.entities
    assert {c.payee_id for c in close_candidates(r.candidates)} == close
    assert r.ambiguity_reason and AMBIGUOUS_PAYEE in r.ambiguity_reason
    names = {p.display_name for p in heldout.customers[customer].payees() if p.payee_id in close}
    assert all(name in r.ambiguity_reason for name in names)
    # Without a model the policy asks, naming both.
    decision = _policy_decision(heldout, customer, r, text)
    assert decision.reply.startswith("Did you mean") and all(name in decision.reply for name in names)
    assert not decision.executed and not decision.needs_confirmation


def test_a_clear_winner_is_not_asked_about():
    def cand(pid: str, score: float) -> Candidate:
        return Candidate(pid, pid, "friend", "person", score, False)

    assert [c.payee_id for c in close_candidates([cand("a", 95.0), cand("b", 95.0 - PAYEE_MARGIN)])] == ["a"]
    assert [c.payee_id for c in close_candidates([cand("a", 95.0), cand("b", 88.0), cand("c", 70.0)])] == [
        "a",
        "b",
    ]
    assert [c.payee_id for c in close_candidates([cand("a", 100.0), cand("b", 99.0)])] == ["a"]  # exact
    assert [c.payee_id for c in close_candidates([cand("a", 100.0), cand("b", 100.0)])] == ["a", "b"]
    assert close_candidates([cand("a", 79.0), cand("b", 79.0)]) == []  # nobody close enough to offer
    assert resolve_payee([cand("a", 95.0), cand("b", 80.0)])[0].payee_id == "a"


@pytest.mark.parametrize(
    ("customer", "text", "payee_id", "reply"),
    [
        (
            "olivia",
            "pay my thames water bill",
            "thames_water",
            "How much would you like to pay Thames Water?",
        ),
        ("alex", "pay my water bill", "metro_water", "How much would you like to pay Metro Water Utility?"),
        ("marcus", "pay my verizon bill", "verizon", "How much would you like to pay Verizon Wireless?"),
        ("wei", "pay my hydro bill", "hydro_one", "How much would you like to pay Hydro One?"),
        ("olivia", "can I pay my tv licence", "tv_licensing", "How much would you like to pay TV Licensing?"),
    ],
)
def test_a_bill_without_an_amount_is_asked_how_much_on_the_fast_path(
    heldout, customer, text, payee_id, reply
):
    """No model can supply an amount nobody said: neither the classifier nor the policy calls Gemma."""
    r = classify(heldout, customer, text)
    assert (r.intent, r.entities.get("payee_id")) == ("bill_payment", payee_id)
    assert "amount_minor" not in r.entities
    assert not r.needs_llm and r.ambiguity_reason == MISSING_AMOUNT
    policy = Policy(heldout.customers[customer])
    session = SessionState("s", customer)
    assert not policy.wants_llm(session, r)
    decision = policy.decide(session, r, text)
    assert decision.reply == reply
    assert not decision.executed and not decision.needs_confirmation and decision.refused is None


def _policy_decision(heldout, customer: str, result, text: str):
    policy = Policy(heldout.customers[customer])
    return policy.decide(SessionState("s", customer), result, text)
