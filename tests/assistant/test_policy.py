"""Policy: no money moves without a confirmation turn in the same session that names the pending action,
cancel and expiry, limits, dates, unknown payees and model-made results re-checked against the customer's
records, card rules, and the turn's audit rows."""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from g4serve_assistant.bank import BankUnavailableError
from g4serve_assistant.db import demo_db
from g4serve_assistant.intents import IntentClassifier, IntentResult
from g4serve_assistant.normalize import normalize
from g4serve_assistant.payees import PayeeIndex
from g4serve_assistant.policy import (
    CONFIRMATION_MISMATCH,
    DATE_IN_PAST,
    INSUFFICIENT_FUNDS,
    INVALID_AMOUNT,
    INVALID_DATE,
    NO_ACCOUNT,
    OVER_LIMIT,
    UNKNOWN_PAYEE,
    UNSUPPORTED_CURRENCY,
    Decision,
    Policy,
    SessionState,
    SessionStore,
)

NOW = dt.datetime(2025, 5, 7, 10, 0)  # a Wednesday
CHECKING = 123_456


SHOWN = object()  # say()'s default: name the action this session's client was last shown, as the page does


class Bank:
    """A demo customer with the fast path and the policy on a clock the test moves. Like the web page, a
    session's client names the pending action it was last shown when it says yes."""

    def __init__(self, **policy_kwargs):
        self.db = demo_db()
        self.classifier = IntentClassifier(PayeeIndex(self.db))
        self.now = NOW.timestamp()
        self.policy = Policy(self.db, clock=lambda: self.now, **policy_kwargs)
        self.sessions = SessionStore()
        self.shown: dict[str, str | None] = {}
        self.audit: dict[str, list] = {}

    def session(self, session: str = "s1") -> SessionState:
        return self.sessions.get(session, self.db.customer_id)

    def say(self, text: str, session: str = "s1", action_id=SHOWN) -> Decision:
        result = self.classifier.classify(normalize(text, now=dt.datetime.fromtimestamp(self.now)))
        return self.decide(result, text, session, action_id)

    def decide(self, result: IntentResult, text: str = "", session: str = "s1", action_id=SHOWN) -> Decision:
        named = self.shown.get(session) if action_id is SHOWN else action_id
        d = self.policy.decide(self.session(session), result, text, named)
        self.shown[session] = d.pending["action_id"] if d.pending else None
        self.audit.setdefault(session, []).extend(d.audit)
        return d

    def checking(self) -> int:
        return self.db.balance("chk-001")["balance_minor"]

    def executed(self) -> list[dict]:
        return self.db.transfers(status="executed")


@pytest.fixture
def bank() -> Bank:
    return Bank()


def gemma(intent: str, **entities) -> IntentResult:
    """A result as the Gemma path makes it: entities straight from the model, no candidates."""
    return IntentResult(intent, 0.9, entities, [], False, None, ["gemma_extraction"])


MONEY_REQUESTS = [
    "send fifty dollars to John Smith",
    "pay my electric bill of eighty four dollars",
    "transfer 5000 yen to yuki tanaka",
    "send 30 euros to hans mueller",
    "wire a hundred and five dollars to priya patel",
    "pay mike rosoft twelve dollars",
    "send twelve fifty to olga ivanova tomorrow",
]


@pytest.mark.parametrize("text", MONEY_REQUESTS)
def test_money_never_moves_on_the_request_turn(bank, text):
    d = bank.say(text)
    assert d.needs_confirmation and not d.executed and d.refused is None
    assert d.action["status"] == "pending" and d.reply.endswith("Say yes to confirm or no to cancel.")
    assert bank.executed() == [] and bank.checking() == CHECKING
    assert [t["status"] for t in bank.db.transfers()] == ["pending"]


def test_yes_executes_the_pending_transfer(bank):
    d = bank.say("send fifty dollars to John Smith")
    assert d.reply == "Send $50.00 to John Smith? Say yes to confirm or no to cancel."
    done = bank.say("yes")
    assert done.executed and not done.needs_confirmation and done.intent == "transfer_money"
    assert done.reply == "Done. I've sent $50.00 to John Smith."
    assert bank.checking() == CHECKING - 5000
    assert [t["transfer_id"] for t in bank.executed()] == [d.action["transfer_id"]]
    again = bank.say("yes")  # a second yes finds nothing: no double payment
    assert not again.executed and "nothing waiting" in again.reply
    assert bank.checking() == CHECKING - 5000


@pytest.mark.parametrize("answer", ["no", "cancel", "no, don't send it", "never mind"])
def test_no_cancels(bank, answer):
    bank.say("send fifty dollars to John Smith")
    d = bank.say(answer)
    assert not d.executed and "cancelled" in d.reply
    assert [t["status"] for t in bank.db.transfers()] == ["cancelled"]
    assert not bank.say("yes").executed
    assert bank.checking() == CHECKING


def test_confirmation_in_another_session_does_nothing(bank):
    bank.say("send fifty dollars to John Smith", session="alice")
    other = bank.say("yes", session="mallory")
    assert not other.executed and "nothing waiting" in other.reply
    assert bank.executed() == [] and bank.db.transfers(status="pending")
    assert bank.say("yes", session="alice").executed


def test_a_transfer_of_another_session_is_never_executed(bank):
    bank.say("send fifty dollars to John Smith", session="alice")
    stolen = bank.session("alice").pending
    bank.session("mallory").pending = stolen  # a bug or a forged state must not move money
    d = bank.say("yes", session="mallory", action_id=stolen.action_id)
    assert not d.executed and d.refused
    assert bank.executed() == []


def test_confirmation_comes_from_the_words_not_the_model(bank):
    bank.say("send fifty dollars to John Smith")
    d = bank.decide(gemma("unknown", confirmation=True), text="hmm let me think")
    assert not d.executed and d.needs_confirmation  # still waiting, with a reminder
    assert "still have a request waiting" in d.reply
    assert bank.executed() == []


def test_pending_expires(bank):
    bank.say("send fifty dollars to John Smith")
    bank.now += bank.policy.confirm_ttl_s + 1
    d = bank.say("yes")
    assert not d.executed and "timed out" in d.reply
    assert [t["status"] for t in bank.db.transfers()] == ["cancelled"]
    assert bank.executed() == [] and bank.checking() == CHECKING


def test_other_turns_keep_the_pending_action_with_a_reminder(bank):
    bank.say("send fifty dollars to John Smith")
    d = bank.say("what's my balance")
    assert d.intent == "balance_inquiry" and d.needs_confirmation and not d.executed
    assert d.reply.startswith("Your checking balance is $1,234.56.")
    assert "send $50.00 to John Smith" in d.reply
    unclear = bank.say("blah blah")
    assert unclear.needs_confirmation and unclear.reply.startswith("You still have a request waiting")
    assert bank.say("yes").executed


def test_a_new_request_replaces_the_pending_one(bank):
    first = bank.say("send fifty dollars to John Smith")
    second = bank.say("send 20 dollars to priya patel")
    assert second.needs_confirmation and second.action["payee_id"] == "priya_patel"
    assert bank.db.transfer(first.action["transfer_id"])["status"] == "cancelled"
    assert bank.say("yes").executed
    assert [t["payee_id"] for t in bank.executed()] == ["priya_patel"]


def test_an_amendment_keeps_what_it_does_not_change(bank):
    bank.say("send 5000 yen to yuki tanaka next friday")
    d = bank.say("actually make it 7000 yen")
    assert d.needs_confirmation
    assert (d.action["amount_minor"], d.action["payee_id"], d.action["scheduled_for"]) == (
        7000,
        "yuki_tanaka",
        "2025-05-09",
    )
    done = bank.say("yes")
    assert (
        done.executed and done.action["status"] == "scheduled" and "scheduled for Friday, May 9" in done.reply
    )


def test_ambiguous_payee_asks_and_the_answer_picks(bank):
    d = bank.say("send 20 dollars to jon smyth")
    assert not d.needs_confirmation and d.reply.startswith("Did you mean")
    assert set(d.action["choices"]) == {"john_smith", "jon_smythe", "joan_smith"}
    assert bank.db.transfers() == []
    picked = bank.say("john smith")
    assert picked.needs_confirmation and picked.action["payee_id"] == "john_smith"
    assert picked.action["amount_minor"] == 2000
    assert bank.say("yes").executed


def test_ordinal_answer_picks_among_choices(bank):
    choices = bank.say("pay catherine twenty dollars").action["choices"]
    d = bank.say("the second one")
    assert d.action["payee_id"] == choices[1] and d.needs_confirmation


def test_missing_amount_is_asked_for(bank):
    d = bank.say("pay my phone bill")
    assert d.reply == "How much would you like to pay Skyline Mobile?" and not d.needs_confirmation
    assert bank.say("yes").reply == d.reply  # a yes is not an amount
    proposal = bank.say("sixty five dollars")
    assert proposal.intent == "bill_payment" and proposal.needs_confirmation
    assert (proposal.action["amount_minor"], proposal.action["type"]) == (6500, "bill_payment")
    assert bank.say("confirm").executed
    assert bank.checking() == CHECKING - 6500


def test_missing_payee_is_asked_for_and_moving_on_drops_the_draft(bank):
    d = bank.say("transfer 100 dollars")
    assert d.reply == "Who would you like to pay?"
    other = bank.say("what's my balance")
    assert other.reply == "Your checking balance is $1,234.56."  # no stale reminder
    assert bank.session("s1").pending is None


def test_limits_are_refused(bank):
    d = bank.say("send 9000 dollars to priya patel")
    assert d.refused == OVER_LIMIT and not d.needs_confirmation
    assert d.reply == "Sorry, that's over your limit of $5,000.00 per payment."
    assert bank.db.transfers() == []


def test_limits_are_configurable_per_currency():
    bank = Bank(limits_minor={"USD": 1000})
    assert bank.say("send twenty dollars to priya patel").refused == OVER_LIMIT
    assert bank.say("send ten dollars to priya patel").needs_confirmation
    assert bank.say("send 30 euros to hans mueller").refused == UNSUPPORTED_CURRENCY


def test_currency_without_an_account_is_refused(bank):
    d = bank.say("give tom wilson twenty quid")
    assert d.refused == NO_ACCOUNT and "GBP" in d.reply


def test_insufficient_funds_is_refused(bank):
    d = bank.say("send 3000 dollars to priya patel")
    assert d.refused == INSUFFICIENT_FUNDS and "$1,234.56" in d.reply


def test_unknown_payee_from_the_fast_path_is_refused(bank):
    d = bank.say("send 20 dollars to zeb quarterman")
    assert d.refused == UNKNOWN_PAYEE
    assert "zeb quarterman" in d.reply and "saved payees" in d.reply
    assert bank.db.transfers() == []


def test_model_results_are_rechecked_against_the_database(bank):
    ghost = bank.decide(gemma("transfer_money", payee_id="ghost", amount_minor=5000, currency="USD"))
    assert ghost.refused == UNKNOWN_PAYEE and bank.db.transfers() == []
    named = bank.decide(
        gemma("transfer_money", payee_name="Zeb Quarterman", amount_minor=5000, currency="USD")
    )
    assert named.refused == UNKNOWN_PAYEE
    ok = bank.decide(gemma("transfer_money", payee_id="john_smith", amount_minor=5000, currency="USD"))
    assert ok.needs_confirmation and not ok.executed  # a confident model still needs the customer's yes


@pytest.mark.parametrize("amount", [-5, 0, "5000", True, 12.5, None])
def test_bad_amounts_from_the_model_are_refused_or_asked(bank, amount):
    d = bank.decide(gemma("transfer_money", payee_id="john_smith", amount_minor=amount, currency="USD"))
    assert not d.needs_confirmation and bank.db.transfers() == []
    if amount is None:
        assert d.reply.startswith("How much")
    else:
        assert d.refused == INVALID_AMOUNT


def test_bad_currency_from_the_model_is_refused(bank):
    d = bank.decide(gemma("transfer_money", payee_id="john_smith", amount_minor=500, currency="XYZ"))
    assert d.refused == INVALID_AMOUNT


def test_biller_payee_makes_it_a_bill_payment(bank):
    d = bank.decide(gemma("transfer_money", payee_id="city_electric", amount_minor=8000, currency="USD"))
    assert d.intent == "bill_payment" and d.action["type"] == "bill_payment"


def test_dates(bank):
    past = bank.decide(
        gemma("transfer_money", payee_id="john_smith", amount_minor=100, currency="USD", date="2025-05-01")
    )
    assert past.refused == DATE_IN_PAST
    later = bank.say("send 10 dollars to john smith on the 20th")
    assert later.action["scheduled_for"] == "2025-05-20" and "Tuesday, May 20" in later.reply
    assert bank.say("yes").action["status"] == "scheduled"
    assert bank.checking() == CHECKING


def test_card_lock_runs_at_once(bank):
    d = bank.say("freeze my debit card")
    assert d.executed and not d.needs_confirmation
    assert d.reply.startswith("I've locked your debit card ending in 4201.")
    assert {c["card_id"]: c["locked"] for c in bank.db.cards()}["card-debit"]
    assert "already locked" in bank.say("lock the card ending in four two oh one").reply


def test_card_lock_asks_which_card_when_several(bank):
    d = bank.say("lock my card")
    assert not d.executed and "debit card ending in 4201 or your credit card ending in 8812" in d.reply
    d = bank.say("the credit one")
    assert d.executed and {c["card_id"]: c["locked"] for c in bank.db.cards()}["card-credit"]


def test_card_unlock_needs_confirmation(bank):
    bank.db.set_card_locked("card-debit", True)
    d = bank.say("unlock my card")  # the only locked card
    assert d.needs_confirmation and not d.executed
    assert d.reply == "Unlock your debit card ending in 4201? Say yes to confirm or no to cancel."
    assert bank.db.cards()[0]["locked"]
    assert bank.say("no").reply == "Okay, I've cancelled that."
    assert bank.db.cards()[0]["locked"]
    bank.say("unlock my debit card")
    assert bank.say("yes").executed
    assert not bank.db.cards()[0]["locked"]


def test_unsure_card_lock_asks_first(bank):
    result = IntentResult("card_lock", 0.6, {"card": "card-debit"}, [], True, "low_confidence", [])
    d = bank.decide(result, "um the card thing")
    assert d.needs_confirmation and not d.executed
    # the model's choice (merge_into_result clears needs_llm) is a lock the fast path was unsure of too
    chosen = IntentResult("card_lock", 0.9, {"card": "card-debit"}, [], False, None, ["gemma_extraction"])
    d = bank.decide(chosen, "the debit card")
    assert d.needs_confirmation and not d.executed


@pytest.mark.parametrize(
    ("text", "intent", "expected"),
    [
        ("what's my balance", "balance_inquiry", "Your checking balance is $1,234.56."),
        ("how much is in my savings account", "balance_inquiry", "Your savings balance is $8,250.00."),
        ("what's the balance on my yen account", "balance_inquiry", "Your yen balance is ¥250,000."),
        (
            "show me my last 2 transactions",
            "recent_transactions",
            (
                "Your last 2 transactions: Pizza Place, $32.40 on May 2; "
                "Transfer from checking, plus $500.00 on May 1."
            ),
        ),
        (
            "is john smith one of my payees",
            "recipient_lookup",
            "Yes, John Smith is one of your saved payees (friend).",
        ),
        ("find stephen clark", "recipient_lookup", "I found Stephen Clarke and Steven Clark."),
        ("is gran one of my payees", "recipient_lookup", "I couldn't find gran among your saved payees."),
        ("talk to a human", "human_handoff", "Connecting you to an agent now."),
        (
            "check my balance and lock my card",
            "card_lock",
            "I can do one thing at a time. What would you like to do first?",
        ),
    ],
)
def test_replies(bank, text, intent, expected):
    d = bank.say(text)
    assert (d.intent, d.reply) == (intent, expected)
    assert not d.needs_confirmation and not d.executed and d.refused is None


def test_qna_is_routed_to_the_knowledge_base(bank):
    d = bank.say("what are your opening hours")
    assert d.intent == "qna" and d.action == {"type": "qna", "question": "what are your opening hours"}


def test_audit_rows_for_every_stage(bank):
    bank.say("send fifty dollars to John Smith")
    bank.say("yes")
    bank.say("send 9000 dollars to priya patel")
    log = [
        {"stage": r.stage, "event": r.event, "detail": r.detail, "outcome": r.outcome}
        for r in bank.audit["s1"]
    ]
    stages = [(r["stage"], r["event"]) for r in log]
    assert ("intent", "transfer_money") in stages
    assert ("lookup", "payee_candidates") in stages
    assert ("policy", "transfer_created") in stages
    assert ("policy", "proposed") in stages
    assert ("execution", "executed") in stages
    assert ("policy", "executed") in stages
    assert ("policy", "refused") in stages
    executed = next(r for r in log if r["stage"] == "execution")
    assert executed["detail"]["payee_id"] == "john_smith" and executed["detail"]["amount_minor"] == 5000
    refused = [r for r in log if r["event"] == "refused"][-1]
    assert refused["detail"]["refused"] == OVER_LIMIT
    assert [r["outcome"] for r in log if r["stage"] == "policy" and r["outcome"]] == [
        "proposed",
        "executed",
        "refused",
    ]


def test_is_confirmation(bank):
    assert bank.policy.is_confirmation("yes please") is True
    assert bank.policy.is_confirmation("cancel") is False
    assert bank.policy.is_confirmation("cancel my card") is None


def test_wants_llm(bank):
    session = SessionState("w", bank.db.customer_id)
    unsure = IntentResult(
        "transfer_money", 0.6, {"amount_minor": 5000, "currency": "USD"}, [], True, "missing_payee", []
    )
    assert bank.policy.wants_llm(session, unsure)
    session.pending = bank.session("w").pending  # None
    bank.policy.decide(session, bank.classifier.classify(normalize("pay my phone bill")), "pay my phone bill")
    assert session.pending.awaiting == "amount"
    assert not bank.policy.wants_llm(session, unsure)  # the amount answers our own question
    sure = IntentResult("balance_inquiry", 0.9, {}, [], False, None, [])
    assert not bank.policy.wants_llm(session, sure)


def test_session_store_is_bounded_and_thread_safe():
    store = SessionStore(max_sessions=3)
    a = store.get("a", "c1")
    assert store.get("a", "c1") is a
    with pytest.raises(PermissionError):
        store.get("a", "c2")  # a session's dialogue state is never handed to another customer
    for sid in ("b", "c", "d"):
        store.get(sid, "c1")
    assert len(store) == 3 and store.get("a", "c1") is not a  # "a" was least recently used: evicted

    store = SessionStore()
    seen: list[SessionState] = []

    def grab() -> None:
        seen.extend(store.get(f"s{i % 10}", "c1") for i in range(200))

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 10 and len({id(s) for s in seen}) == 10


def test_concurrent_yes_executes_once(bank):
    bank.say("send fifty dollars to John Smith")
    session = bank.session("s1")
    yes = bank.classifier.classify(normalize("yes"))
    results: list[Decision] = []
    named = bank.shown["s1"]
    threads = [
        threading.Thread(target=lambda: results.append(bank.policy.decide(session, yes, "yes", named)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(d.executed for d in results) == 1
    assert bank.checking() == CHECKING - 5000


@pytest.mark.parametrize(
    "text",
    [
        "send minus fifty dollars to John Smith",
        "send -$50 to John Smith",
        "send $-50 to John Smith",
        "transfer negative 20 dollars to John Smith",
        "pay john smith \u221250 dollars",
    ],
)
def test_a_negative_amount_is_refused_with_its_reason(bank, text):
    """Issue 20: "minus fifty" / "-$50" was proposed as +$50.00, the sign dropped."""
    assert [m.amount_minor for m in normalize(text).amounts] in ([-5000], [-2000])
    d = bank.say(text)
    assert d.refused == INVALID_AMOUNT and not d.needs_confirmation and not d.executed
    assert "above zero" in d.reply and "-$" in d.reply
    assert bank.db.transfers() == [] and bank.checking() == CHECKING


def test_a_zero_amount_is_refused_and_dashes_elsewhere_are_not_signs(bank):
    d = bank.say("send zero dollars to John Smith")
    assert d.refused == INVALID_AMOUNT and "above zero" in d.reply
    for text, minor in [("pay t-mobile 20 dollars", 2000), ("send 50 dollars on 2025-05-09", 5000)]:
        assert [m.amount_minor for m in normalize(text, now=NOW).amounts] == [minor]


def test_a_yes_must_name_the_pending_action(bank):
    """Issue 20: a confirmation names the action it confirms, in the same session of the same customer."""
    d = bank.say("send fifty dollars to John Smith")
    action_id = d.pending["action_id"]
    assert d.action["action_id"] == action_id and d.pending["kind"] == "transfer_money"
    assert d.pending["expires_at"] == pytest.approx(bank.now + 60)
    for named in (None, "a-made-up", action_id + "x"):
        refused = bank.say("yes", action_id=named)
        assert not refused.executed and refused.refused == CONFIRMATION_MISMATCH
        assert "send $50.00 to John Smith" in refused.reply
    assert bank.executed() == [] and bank.checking() == CHECKING
    assert bank.say("yes", action_id=action_id).executed
    assert bank.checking() == CHECKING - 5000


def test_a_yes_naming_a_replaced_action_confirms_nothing(bank):
    """The client was shown the $50 proposal; meanwhile a $500 one replaced it. Its yes must not pay $500."""
    first = bank.say("send fifty dollars to John Smith")
    bank.say("make it five hundred dollars")
    d = bank.say("yes", action_id=first.pending["action_id"])
    assert not d.executed and d.refused == CONFIRMATION_MISMATCH
    assert bank.executed() == [] and bank.checking() == CHECKING


def test_the_action_id_is_the_idempotency_key(bank):
    d = bank.say("send fifty dollars to John Smith")
    bank.say("yes")
    (done,) = bank.executed()
    assert (
        done["transfer_id"] == d.action["transfer_id"] and done["idempotency_key"] == d.pending["action_id"]
    )


def test_confirmations_expire_after_60_s(bank):
    bank.say("send fifty dollars to John Smith")
    bank.now += 61
    d = bank.say("yes")
    assert not d.executed and "timed out" in d.reply and bank.executed() == []


@pytest.mark.parametrize("date", ["8888-00-95", "2025-02-30", "tomorrowish", "2025-13-01"])
def test_an_impossible_date_is_a_question_never_a_value(bank, date):
    """Issue 20's repro: the model answered date "8888-00-95", which passed validation."""
    d = bank.decide(
        gemma("transfer_money", payee_id="john_smith", amount_minor=5000, currency="USD", date=date)
    )
    assert not d.executed and not d.needs_confirmation and d.refused is None
    assert "valid date" in d.reply and "John Smith" in d.reply
    assert bank.db.transfers() == []  # nothing was proposed, let alone scheduled
    answered = bank.say("on the 20th")
    assert answered.needs_confirmation and answered.action["scheduled_for"] == "2025-05-20"
    assert answered.action["amount_minor"] == 5000 and answered.action["payee_id"] == "john_smith"


def test_a_date_beyond_a_year_is_refused(bank):
    d = bank.decide(
        gemma("transfer_money", payee_id="john_smith", amount_minor=100, currency="USD", date="2027-01-01")
    )
    assert d.refused == INVALID_DATE and bank.db.transfers() == []


def test_a_policy_of_one_customer_refuses_another_customers_session(bank):
    other = SessionState("s9", "cust-002")
    with pytest.raises(PermissionError):
        bank.policy.decide(other, bank.classifier.classify(normalize("yes")), "yes")


class LostAnswer:
    """A bank whose first execute moves the money and then fails to answer (the reply was lost)."""

    def __init__(self, view, before: bool = False):
        self.view, self.calls, self.before = view, 0, before

    def __getattr__(self, name):
        return getattr(self.view, name)

    def execute_transfer(self, transfer_id, idempotency_key, today=None):
        self.calls += 1
        if self.calls == 1 and self.before:
            raise BankUnavailableError("timed out before the bank got it")
        done = self.view.execute_transfer(transfer_id, idempotency_key, today)
        if self.calls == 1:
            raise BankUnavailableError("the answer was lost")
        return done


@pytest.mark.parametrize("before", [False, True])
def test_a_yes_retried_after_the_bank_failed_pays_once(bank, before):
    lossy = LostAnswer(bank.db, before)
    bank.policy.db = lossy
    bank.say("send fifty dollars to John Smith")
    with pytest.raises(BankUnavailableError):
        bank.say("yes")
    assert bank.session().pending is not None  # still waiting for the retried yes
    done = bank.say("yes")  # the client retries with the same action id
    assert done.executed and lossy.calls == 2
    assert bank.checking() == CHECKING - 5000 and len(bank.executed()) == 1
    assert not bank.say("yes").executed


@pytest.mark.parametrize(
    "text",
    [
        "pay John Smith 50 dollars on 2025-02-30",
        "send john smith 50 dollars on february 30th",
        "send 50 dollars to john smith on the 31st of april",  # was proposed for May 31
        "send 50 dollars to john smith on 3/15",
    ],
)
def test_an_impossible_spoken_date_is_asked_for_never_paid_now(bank, text):
    """The normalizer dropped the date it could not resolve, and the transfer was proposed for today."""
    d = bank.say(text)
    assert not d.needs_confirmation and not d.executed and d.refused is None
    assert "valid date" in d.reply and "John Smith" in d.reply and d.action["missing"] == "date"
    assert bank.db.transfers() == []  # nothing proposed for today, nor any other day
    assert ("policy", "invalid_date") in [(r.stage, r.event) for r in bank.audit["s1"]]
    again = bank.say("on february 30th")  # another impossible answer asks again, keeping the draft
    assert "valid date" in again.reply and bank.db.transfers() == []
    assert bank.say("yes").reply == again.reply  # a yes is not a date
    answered = bank.say("on the 20th")
    assert answered.needs_confirmation and answered.action["scheduled_for"] == "2025-05-20"
    assert (answered.action["amount_minor"], answered.action["payee_id"]) == (5000, "john_smith")


def test_an_impossible_date_with_the_missing_amount_is_still_asked_for(bank):
    bank.say("send money to john smith")
    d = bank.say("50 dollars on february 30th")
    assert "valid date" in d.reply and not d.needs_confirmation and bank.db.transfers() == []


@pytest.mark.parametrize(
    "text",
    [
        "send 1.5 cents to john smith",  # was $0.05
        "send ½ dollars to john smith",  # was $2.00
        "send 6² dollars to john smith",  # was $62.00
        "send ① dollar to john smith",
        "send half a dollar to john smith",  # was $1.00
        "send 20 dollars and 1.5 cents to john smith",  # was $20.01
        "send 1/2 dollars to john smith",
    ],
)
def test_an_amount_that_cannot_be_paid_as_said_is_asked_for(bank, text):
    d = bank.say(text)
    assert d.reply == "How much would you like to send to John Smith?", d.reply
    assert not d.needs_confirmation and bank.db.transfers() == []
    assert bank.say("five dollars").action["amount_minor"] == 500
