"""The assistant pipeline without a model: fast-path turns with stage timings, confirmation across turns,
clarifying questions instead of guesses, payee changes reaching the recogniser, streaming end-pointing,
QnA."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading

import numpy as np
import pytest

from g4serve_assistant.audio import AudioError
from g4serve_assistant.bank import BankUnavailableError, Payee
from g4serve_assistant.db import DEMO_CUSTOMER_2_ID, DEMO_CUSTOMER_ID, demo_bank
from g4serve_assistant.knowledge import DOCUMENTS
from g4serve_assistant.metrics import AssistantMetrics
from g4serve_assistant.pipeline import NOT_HEARD_REPLY, Assistant, Caller, StageClock, Utterance
from g4serve_assistant.qna import KnowledgeIndex, answer_events
from g4serve_assistant.vad import VadEvent


class FakeStream:
    def __init__(self, owner):
        self.owner, self.fed = owner, []

    def feed(self, pcm):
        self.fed.append(np.asarray(pcm))
        return f"partial {len(self.fed)}"

    def finish(self):
        from g4serve_assistant.asr import Transcript

        samples = sum(a.size for a in self.fed)
        return Transcript(
            text=self.owner.say, partials=[], confidence=0.9, recognizer="fake", audio_s=samples / 16000
        )


class FakeRecognizer:
    """Records vocabulary updates; 'hears' whatever ``say`` is set to."""

    name = "fake"

    def __init__(self):
        self.vocabularies, self.streams, self.say = [], [], "what's my balance"

    def update_vocabulary(self, vocab):
        self.vocabularies.append(vocab)

    def stream(self):
        self.streams.append(FakeStream(self))
        return self.streams[-1]

    def transcribe(self, audio):
        stream = self.stream()
        stream.feed(audio)
        return stream.finish()


class ScriptedVad:
    """Speech starts in the 3rd chunk and ends in the 6th."""

    def __init__(self):
        self.chunks = 0

    def reset(self):
        self.chunks = 0

    def feed(self, chunk):
        self.chunks += 1
        return {3: [VadEvent("start", 0.2)], 6: [VadEvent("end", 0.5)]}.get(self.chunks, [])


@pytest.fixture
def assistant():
    assistant = Assistant(demo_bank(), None, recognizer=FakeRecognizer())
    assistant.db = assistant.bank.customer(DEMO_CUSTOMER_ID)  # the demo customer's records, for the asserts
    return assistant


SHOWN = object()


def turn(assistant, session, text, customer=DEMO_CUSTOMER_ID, action_id=SHOWN):
    """A typed turn; like the web page, the client names the pending action it was last shown."""
    shown = assistant.__dict__.setdefault("_shown", {})
    named = shown.get(session) if action_id is SHOWN else action_id
    r = asyncio.run(assistant.turn(Caller(customer, session, {"ip": "test"}, named), text=text)).to_dict()
    shown[session] = (r["pending"] or {}).get("action_id")
    return r


def test_fast_path_reports_every_stage(assistant):
    r = turn(assistant, "s", "what's my balance")
    assert (r["intent"], r["path"], r["executed"], r["needs_llm"]) == (
        "balance_inquiry",
        "fast",
        False,
        False,
    )
    assert r["reply"] == "Your checking balance is $1,234.56."
    assert {"normalize", "lookup", "intent", "policy", "total"} <= set(r["stages"])
    assert all(v >= 0 for v in r["stages"].values())
    assert r["stages"]["total"] >= r["stages"]["normalize"] + r["stages"]["policy"]
    assert list(r["timeline"]) == ["normalize", "intent", "policy", "response_sent"]
    json.dumps(r)  # the whole result is JSON


def test_money_moves_only_on_a_confirmation_turn_of_the_same_session(assistant):
    db = assistant.db
    r = turn(assistant, "a", "transfer $120.50 to Priya Patel")
    assert r["needs_confirmation"] and not r["executed"]
    assert (
        r["entities"] | {"amount_minor": 12050, "currency": "USD", "payee_id": "priya_patel"} == r["entities"]
    )
    assert [t["status"] for t in db.transfers()] == ["pending"]
    assert not turn(assistant, "b", "yes")["executed"]  # another session
    r = turn(assistant, "a", "what's my balance")  # an unrelated turn keeps the proposal and says so
    assert "still have a request waiting" in r["reply"] and r["needs_confirmation"]
    assert db.transfers(status="executed") == []
    r = turn(assistant, "a", "no")
    assert not r["executed"] and [t["status"] for t in db.transfers()] == ["cancelled"]
    r = turn(assistant, "a", "yes")
    assert not r["executed"] and db.transfers(status="executed") == []
    turn(assistant, "a", "pay City Electric 94 dollars and 20 cents")
    r = turn(assistant, "a", "yes")
    assert r["executed"] and r["intent"] == "bill_payment"
    (done,) = db.transfers(status="executed")
    assert (done["payee_id"], done["amount_minor"], done["kind"]) == ("city_electric", 9420, "bill_payment")


def test_unsure_without_a_model_asks_instead_of_guessing(assistant):
    r = turn(assistant, "c", "send fifty to jon")
    assert r["path"] == "fast" and r["needs_llm"] and r["reply"].startswith("Did you mean")
    assert not r["needs_confirmation"]
    assert len(r["candidates"]) >= 2 and all({"id", "name", "score"} <= set(c) for c in r["candidates"])
    assert assistant.db.transfers() == []
    r = turn(assistant, "c", "the first one")
    assert r["needs_confirmation"]
    first = r["action"]["payee_id"]
    r = turn(assistant, "c", "yes")
    assert r["executed"] and assistant.db.transfers(status="executed")[0]["payee_id"] == first


def test_refusals_are_clear_and_counted(assistant):
    r = turn(assistant, "d", "send 9000 dollars to Tom Wilson")
    assert r["refused"] == "over_limit" and "limit" in r["reply"] and not r["needs_confirmation"]
    r = turn(assistant, "d", "send 20 dollars to Gran")
    assert r["refused"] == "unknown_payee" and "saved payees" in r["reply"]
    assert assistant.db.transfers() == []
    metrics = assistant.metrics.render().decode()
    assert 'g4serve_assistant_refusals_total{reason="over_limit"} 1.0' in metrics
    AssistantMetrics()  # a second registry in one process: no duplicate-registration error


def test_qna_turn_answers_from_the_knowledge_base_and_keeps_a_pending_reminder(assistant):
    r = turn(assistant, "q", "how much does an ATM withdrawal cost")
    assert r["intent"] == "qna" and r["documents"][0] == "atm-fees" and "$2.50" in r["reply"]
    turn(assistant, "q", "send 25 dollars to Tom Wilson")
    r = turn(assistant, "q", "what are your branch hours")
    assert r["reply"].startswith("Branches are open") and "still have a request waiting" in r["reply"]


@pytest.mark.parametrize(
    ("question", "doc_id"),
    [
        ("what time do branches open on saturday", "branch-hours"),
        ("how much does it cost to use another bank's atm", "atm-fees"),
        ("what is the overdraft fee", "overdraft"),
        ("I need a new card, how long does replacement take", "card-replacement"),
        ("what's the cutoff for international wires", "wire-cutoff"),
        ("what interest rate does savings pay", "savings-rates"),
        ("what is your routing number", "direct-deposit"),
        ("how much can I take out of an atm per day", "atm-limits"),
    ],
)
def test_retrieval_finds_the_document(question, doc_id):
    hits = KnowledgeIndex().search(question)
    assert hits and hits[0].document.doc_id == doc_id, [(h.document.doc_id, round(h.score, 2)) for h in hits]


def test_knowledge_base_and_extractive_stream():
    assert 18 <= len(DOCUMENTS) <= 30 and len({d.doc_id for d in DOCUMENTS}) == len(DOCUMENTS)
    assert KnowledgeIndex().search("zebra giraffe") == []

    async def collect(question):
        return [e async for e in answer_events(question, KnowledgeIndex(), engine=None)]

    events = asyncio.run(collect("what are the wire fees"))
    assert [e["type"] for e in events] == ["documents", "delta", "done"]
    assert events[0]["documents"][0]["doc_id"] == "wire-fees" and events[-1]["path"] == "extractive"
    events = asyncio.run(collect("zebra giraffe"))
    assert "agent" in events[1]["text"]  # nothing retrieved: a hand-off, not a guess


def test_payee_changes_rebuild_the_recogniser_vocabulary(assistant):
    recognizer = assistant.recognizer(DEMO_CUSTOMER_ID)
    assert recognizer.vocabularies[-1].version == assistant.db.version
    assert "zed" not in recognizer.vocabularies[-1].words()
    assistant.db.upsert_payee(Payee("zed_newman", "Zed Newman", "friend", "person"))
    assert assistant.recognizer(DEMO_CUSTOMER_ID) is recognizer
    assert (
        recognizer.vocabularies[-1].version == assistant.db.version
        and "zed" in recognizer.vocabularies[-1].words()
    )
    r = turn(assistant, "z", "send 10 dollars to Zed Newman")
    assert r["entities"]["payee_id"] == "zed_newman" and r["needs_confirmation"]


def test_whole_recording_turn_with_silence_and_with_speech(assistant):
    caller = Caller(DEMO_CUSTOMER_ID, "au")
    r = asyncio.run(assistant.turn(caller, audio=np.zeros(16000, np.float32))).to_dict()
    assert r["reply"] == NOT_HEARD_REPLY and r["transcript"] == "" and "vad" in r["stages"]
    assert assistant.recognizer(DEMO_CUSTOMER_ID).streams == []  # no speech: the recogniser never ran
    rows = assistant.audit.entries(DEMO_CUSTOMER_ID, "au")
    assert [(r["stage"], r["outcome"]) for r in rows] == [("asr", None), ("turn", "not_heard")]


def test_streaming_utterance_end_points_and_times_its_stages():
    recognizer = FakeRecognizer()
    utterance = Utterance(ScriptedVad(), recognizer)
    chunks = [np.full(1600, i, np.float32) for i in range(1, 9)]
    events = [utterance.feed(c) for c in chunks[:6]]
    assert events[:2] == [[], []]
    assert events[2] == [
        {"type": "vad", "event": "start", "t_s": 0.2},
        {"type": "partial", "text": "partial 1"},
    ]
    assert events[5][0] == {"type": "vad", "event": "end", "t_s": 0.5} and utterance.ended
    assert utterance.feed(chunks[6]) == []  # after the end point: dropped
    stream = recognizer.streams[0]
    assert stream.fed[0].size == 3 * 1600  # the pre-roll before VAD fired reached the recogniser
    heard, clock = utterance.finish()
    assert heard.text == "what's my balance" and not utterance.ended
    for mark in ("audio_received", "vad_start", "asr_partial", "vad_end", "asr_final"):
        assert mark in clock.timeline
    assert {"vad", "asr_partial", "asr_final"} <= set(clock.stages)
    # A finished utterance resets: the next speech opens a new recogniser stream.
    for c in chunks[:3]:
        utterance.feed(c)
    assert len(recognizer.streams) == 2


def test_stream_turn_reports_time_after_the_end_point(assistant):
    clock = StageClock()
    clock.mark("vad_end")
    r = asyncio.run(assistant.decide(Caller(DEMO_CUSTOMER_ID, "st"), "what's my balance", clock)).to_dict()
    assert r["stages"]["after_vad_end"] <= r["stages"]["total"]


def test_endless_speech_is_cut_at_max_utterance_length():
    class AlwaysSpeech(ScriptedVad):
        def feed(self, chunk):
            self.chunks += 1
            return [VadEvent("start", 0.0)] if self.chunks == 1 else []

    utterance = Utterance(AlwaysSpeech(), FakeRecognizer(), max_utterance_s=1.0)
    events = [e for _ in range(15) for e in utterance.feed(np.zeros(1600, np.float32))]
    assert events[-1] == {"type": "vad", "event": "end", "reason": "max_utterance_s"} and utterance.ended


class SpeechAt:
    """VAD that reports speech starting at stream time ``start_s`` (in whichever chunk reaches it)."""

    def __init__(self, start_s: float):
        self.start_s, self.fed = start_s, 0

    def reset(self):
        self.fed = 0

    def feed(self, chunk):
        before, self.fed = self.fed, self.fed + chunk.size
        return [VadEvent("start", self.start_s)] if before <= self.start_s * 16000 < self.fed else []


@pytest.mark.parametrize(
    "chunks_s",
    [
        [90.0],  # the finding: one 90 s frame, all of it pre-roll when VAD fired in it
        [0.1, 90.0],  # speech already started, then one huge frame
        [0.1] * 5 + [60.0, 60.0],
    ],
)
def test_no_chunking_gives_the_recogniser_more_than_the_cap(chunks_s):
    """Finding: a client's single 90 s WebSocket frame was transcribed whole (~12 s of the shared audio
    thread), because the pre-roll handed over at the VAD start, and the frame it came in, were not counted
    against ``max_utterance_s``; a huge frame mid-speech was decoded before the cap was checked."""
    recognizer = FakeRecognizer()
    utterance = Utterance(SpeechAt(0.0), recognizer, max_utterance_s=30.0)
    events = [e for s in chunks_s for e in utterance.feed(np.zeros(round(s * 16000), np.float32))]
    assert sum(a.size for a in recognizer.streams[0].fed) == 30 * 16000
    assert events[-1] == {"type": "vad", "event": "end", "reason": "max_utterance_s"} and utterance.ended
    heard, _ = utterance.finish()
    assert heard.audio_s == 30.0


@pytest.mark.parametrize(
    ("chunks_s", "start_s", "handed_s"),
    [
        ([90.0, 0.1], 90.0, 0.6),  # a long silence sent as one frame is not pre-roll
        ([5.0], 4.0, 1.5),  # speech late in a long frame: 0.5 s before its start, not the 4 s of silence
        ([0.1] * 3, 0.2, 0.3),  # the page's 100 ms chunks: everything so far
    ],
)
def test_the_pre_roll_is_half_a_second_before_the_vad_start(chunks_s, start_s, handed_s):
    recognizer = FakeRecognizer()
    utterance = Utterance(SpeechAt(start_s), recognizer)
    for s in chunks_s:
        utterance.feed(np.zeros(round(s * 16000), np.float32))
    assert recognizer.streams[0].fed[0].size == round(handed_s * 16000)


def test_a_whole_recording_over_the_cap_is_refused(assistant):
    """The WAV route caps its audio when decoding; samples given directly are checked in ``hear`` too."""
    with pytest.raises(AudioError, match="30"):
        asyncio.run(assistant.turn(Caller(DEMO_CUSTOMER_ID, "long"), audio=np.zeros(31 * 16000, np.float32)))
    assert assistant.recognizer(DEMO_CUSTOMER_ID).streams == []


def test_ending_a_session_cancels_its_pending_transfer(assistant):
    """Logging out (``end_session``) cancels the session's proposal in the bank, as a replacing request
    does; a yes naming it afterwards finds nothing waiting."""
    proposal = turn(assistant, "e", "send 40 dollars to Tom Wilson")
    (pending,) = assistant.db.transfers(status="pending")
    asyncio.run(assistant.end_session(Caller(DEMO_CUSTOMER_ID, "e", {"ip": "test"})))
    assert assistant.db.transfer(pending["transfer_id"])["status"] == "cancelled"
    r = turn(assistant, "e", "yes", action_id=proposal["pending"]["action_id"])
    assert not r["executed"] and assistant.db.transfers(status="executed") == []
    rows = assistant.audit.entries(DEMO_CUSTOMER_ID, "e")
    assert ("policy", "pending_ended") in [(row["stage"], row["event"]) for row in rows]
    asyncio.run(assistant.end_session(Caller(DEMO_CUSTOMER_ID, "no-turns-yet")))  # nothing to cancel


def test_a_logout_the_bank_did_not_answer_keeps_the_proposal_for_the_retry(assistant, monkeypatch):
    turn(assistant, "e2", "send 40 dollars to Tom Wilson")
    view = assistant.customer(DEMO_CUSTOMER_ID).view

    def bank_down(transfer_id):
        raise BankUnavailableError("injected")

    monkeypatch.setattr(view, "cancel_transfer", bank_down)
    with pytest.raises(BankUnavailableError):
        asyncio.run(assistant.end_session(Caller(DEMO_CUSTOMER_ID, "e2")))
    assert [t["status"] for t in assistant.db.transfers()] == ["pending"]
    monkeypatch.undo()
    asyncio.run(assistant.end_session(Caller(DEMO_CUSTOMER_ID, "e2")))  # the retried logout
    assert [t["status"] for t in assistant.db.transfers()] == ["cancelled"]


def test_customers_are_isolated(assistant):
    """Two customers of one assistant: each sees and pays only their own payees, and one cannot confirm
    (or even name) the other's pending action."""
    other = assistant.bank.customer(DEMO_CUSTOMER_2_ID)
    mine = turn(assistant, "a", "send fifty dollars to John Smith")
    assert mine["needs_confirmation"] and mine["entities"]["payee_id"] == "john_smith"
    assert (
        turn(assistant, "b", "what's my balance", customer=DEMO_CUSTOMER_2_ID)["reply"]
        != turn(assistant, "a2", "what's my balance")["reply"]
    )
    # The second customer has a Jon Smith of their own: their "John Smith" can only ever be theirs.
    r = turn(assistant, "b", "send fifty dollars to John Smith", customer=DEMO_CUSTOMER_2_ID)
    theirs = {p.payee_id for p in other.payees()}
    assert r["candidates"] and {c["id"] for c in r["candidates"]} <= theirs
    action = r["action"] or {}
    assert set(action.get("choices") or [action.get("payee_id")]) <= theirs  # proposed to, or asked about
    assert other.payee("john_smith") is None
    turn(assistant, "b", "no", customer=DEMO_CUSTOMER_2_ID)
    # The other customer's client replays the first one's session and action id: refused, nothing moves.
    with pytest.raises(PermissionError):
        turn(assistant, "a", "yes", customer=DEMO_CUSTOMER_2_ID, action_id=mine["pending"]["action_id"])
    assert assistant.db.transfers(status="executed") == [] and other.transfers(status="executed") == []
    assert turn(assistant, "a", "yes")["executed"]


def test_every_turn_is_audited_with_customer_client_and_outcome(assistant):
    turn(assistant, "s", "send fifty dollars to John Smith")
    turn(assistant, "s", "yes", action_id="a-wrong")
    turn(assistant, "s", "yes")
    rows = assistant.audit.entries(DEMO_CUSTOMER_ID, "s")
    assert {r["customer_id"] for r in rows} == {DEMO_CUSTOMER_ID} and rows[0]["client"] == {"ip": "test"}
    turns = [r for r in rows if r["stage"] == "turn"]
    assert [r["outcome"] for r in turns] == ["proposed", "refused", "executed"]
    assert assistant.audit.verify().ok


def test_a_bare_amount_is_in_the_customers_own_currency(assistant):
    """cust-002 banks in pounds: their "send twenty to Thames Water" is GBP 20, not USD."""
    r = turn(assistant, "gbp", "pay thames water twenty", customer=DEMO_CUSTOMER_2_ID)
    assert (r["entities"]["amount_minor"], r["entities"]["currency"]) == (2000, "GBP")
    assert turn(assistant, "usd", "send twenty to Tom Wilson")["entities"]["currency"] == "USD"


def test_an_impossible_date_or_an_unreadable_amount_is_a_question(assistant):
    """Whole turns: "february 30th" used to vanish (proposed for today), "6² dollars" became $62.00."""
    r = turn(assistant, "date", "send 25 dollars to Tom Wilson on february 30th")
    assert "valid date" in r["reply"] and not r["needs_confirmation"]
    assert r["entities"]["date"] == "february 30th"
    r = turn(assistant, "amount", "send 6² dollars to Tom Wilson")
    assert r["reply"] == "How much would you like to send to Tom Wilson?" and not r["needs_confirmation"]
    assert "amount_minor" not in r["entities"]
    assert assistant.db.transfers() == []


def _hanging_confirmation(assistant, monkeypatch) -> tuple[Caller, threading.Event, threading.Event]:
    """The first demo customer's proposal, and the yes confirming it, whose bank execution hangs (``started``
    set) until ``gate`` is set."""
    proposal = turn(assistant, "slow", "send 40 dollars to Tom Wilson")
    started, gate = _hold(monkeypatch, assistant.customer(DEMO_CUSTOMER_ID).view, "execute_transfer")
    return Caller(DEMO_CUSTOMER_ID, "slow", {"ip": "test"}, proposal["pending"]["action_id"]), started, gate


def _hold(monkeypatch, owner, name: str) -> tuple[threading.Event, threading.Event]:
    """``owner.name`` made to wait, once called (``started`` set), until ``gate`` is set."""
    started, gate = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def held(*args, **kwargs):
        started.set()
        assert gate.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return started, gate


def test_a_bank_call_that_hangs_holds_up_no_other_customer(assistant, monkeypatch):
    """A decision holds its customer's lock while it calls the bank (a remote one may take its whole timeout).
    With one lock for all customers, every other customer's turn waited behind it, and the threads waiting
    filled the event loop's small default pool."""
    yes, started, gate = _hanging_confirmation(assistant, monkeypatch)

    async def scenario():
        confirming = asyncio.create_task(assistant.turn(yes, text="yes"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        other = Caller(DEMO_CUSTOMER_2_ID, "other", {"ip": "test"})
        try:  # the first customer's execution is inside the bank, which does not answer
            balance = [assistant.turn(other, text="what's my balance") for _ in "ab"]
            replies = [await asyncio.wait_for(turn, 5) for turn in balance]
        finally:
            gate.set()
        return replies, await confirming

    replies, confirmed = asyncio.run(scenario())
    assert all(r.intent == "balance_inquiry" for r in replies)
    assert confirmed.executed


def test_one_customers_waiting_turns_hold_no_worker_threads(assistant, monkeypatch):
    """A customer's decisions run one at a time. Its turns that wait for the one inside a hanging bank call
    waited in worker threads, so a few sessions of one customer filled the event loop's small pool (6
    threads on 2 cores) and every other customer's turn queued behind them. They wait on the event loop."""
    yes, started, gate = _hanging_confirmation(assistant, monkeypatch)

    async def scenario():
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(3))
        confirming = asyncio.create_task(assistant.turn(yes, text="yes"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        mine = [  # more of the same customer's sessions than the pool has threads
            asyncio.create_task(assistant.turn(Caller(DEMO_CUSTOMER_ID, f"s{i}"), text="what's my balance"))
            for i in range(4)
        ]
        await asyncio.sleep(0.2)
        other = Caller(DEMO_CUSTOMER_2_ID, "other", {"ip": "test"})
        try:
            reply = await asyncio.wait_for(assistant.turn(other, text="what's my balance"), 5)
        finally:
            gate.set()
        return reply, await confirming, await asyncio.gather(*mine)

    reply, confirmed, mine = asyncio.run(scenario())
    assert reply.intent == "balance_inquiry" and confirmed.executed
    assert all(r.intent == "balance_inquiry" for r in mine)


def test_a_confirmation_cancelled_inside_the_bank_is_still_audited_and_written(assistant, monkeypatch):
    """Finding: a turn cancelled while its yes was inside the bank (a server stopping, a socket closed) let
    go of its session unchanged while the worker thread went on and executed the transfer: the money moved
    with no audit row, and the session still showed the proposal as pending. The decision, the state it
    leaves and its audit now finish together, cancelled or not."""
    yes, started, gate = _hanging_confirmation(assistant, monkeypatch)

    async def scenario():
        confirming = asyncio.create_task(assistant.turn(yes, text="yes"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        confirming.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await confirming
        await asyncio.sleep(0)  # what the cancelled turn still had to do is done by now
        return await asyncio.wait_for(
            assistant.turn(Caller(DEMO_CUSTOMER_ID, "slow", {"ip": "test"}), text="what's my balance"), 5
        )

    after = asyncio.run(scenario())
    assert [t["status"] for t in assistant.db.transfers()] == ["executed"]
    turns = [r for r in assistant.audit.entries(DEMO_CUSTOMER_ID, "slow") if r["stage"] == "turn"]
    assert [r["outcome"] for r in turns] == ["proposed", "executed", "answered"]
    assert after.pending is None and after.intent == "balance_inquiry"


def test_a_turn_cancelled_while_it_takes_its_session_lets_it_go(assistant, monkeypatch):
    """A turn cancelled while its worker thread was taking the session (and classifying) left the session
    held by a turn nobody would end, until its 30 s lease lapsed: the sweep of a stopping server skipped it,
    and the proposal it held stayed pending in the bank. The session is let go once the thread is done."""
    turn(assistant, "held", "send 40 dollars to Tom Wilson")  # a proposal, pending in the bank
    started, gate = _hold(monkeypatch, assistant.customer(DEMO_CUSTOMER_ID).classifier, "classify")

    async def scenario():
        cut = asyncio.create_task(assistant.turn(Caller(DEMO_CUSTOMER_ID, "held", {"ip": "test"}), text="hm"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        cut.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await cut

    asyncio.run(scenario())
    assistant.sweeper.drain()  # what a server keeping sessions in memory does as it stops
    assert [t["status"] for t in assistant.db.transfers()] == ["cancelled"]
