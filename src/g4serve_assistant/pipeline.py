"""One assistant turn, stage by stage: audio -> VAD -> ASR -> normalize -> payee lookup -> intent -> (Gemma
extraction only when the fast path is unsure) -> policy, with a timestamp and duration for every stage."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from g4serve_assistant.audio import SAMPLE_RATE, AudioError, decode_wav
from g4serve_assistant.audit import AuditLog, AuditRow
from g4serve_assistant.bank import BankBackend, CustomerBank, UnknownCustomerError
from g4serve_assistant.intents import IntentClassifier
from g4serve_assistant.metrics import AssistantMetrics
from g4serve_assistant.normalize import normalize
from g4serve_assistant.payees import PayeeIndex
from g4serve_assistant.policy import Policy, SessionStore
from g4serve_assistant.qna import KnowledgeIndex, extractive_answer
from g4serve_assistant.state import ConversationStore, StateStore
from g4serve_assistant.sweeper import ProposalSweeper

log = logging.getLogger("g4serve_assistant")

NOT_HEARD_REPLY = "Sorry, I didn't catch that. Could you say it again?"
# Chunk size when a whole recording is fed to the streaming recogniser: small enough that the first
# partial comes early (its time is a reported stage), large enough that per-call overhead stays small.
_ASR_CHUNK_S = 0.25
# The most audio one utterance hands the recogniser, streamed or whole (decode_wav's cap as well).
MAX_UTTERANCE_S = 30.0


T = TypeVar("T")
_RUNNING: set[asyncio.Future] = set()  # run_to_end's work, held until done (the loop keeps tasks weakly)


async def run_to_end(work: Awaitable[T], undo: Callable[[T], object] | None = None) -> T:
    """``await work``, which runs to its end even if the caller is cancelled meanwhile: the caller's
    ``CancelledError`` comes once it has, after ``undo(its result)`` (in a worker thread) if given. For the
    steps that take a session, move money or write the audit, which a cancellation must never cut half-way.
    A caller cancelled again while it waits (anyio's cancel scope cancels at every await) stops waiting, and
    the work still runs to its end."""
    task = asyncio.ensure_future(work)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if undo is not None and not task.cancelled() and task.exception() is None:
            await asyncio.to_thread(undo, task.result())
        raise


class StageClock:
    """Durations (``stages``, ms) and timestamps (``timeline``, ms since the turn began) of one turn."""

    def __init__(self, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.stages: dict[str, float] = {}
        self.timeline: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> float:
        at = time.perf_counter() if at is None else at
        self.timeline[name] = round((at - self.t0) * 1000, 3)
        return at

    def add(self, name: str, ms: float) -> None:
        self.stages[name] = round(self.stages.get(name, 0.0) + ms, 3)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.add(name, (end - start) * 1000)
            self.mark(name, end)


@dataclass(frozen=True)
class Caller:
    """Who a turn is for, as the app established it: the customer (from a verified token), their
    server-issued session, the client (address, user agent, origin, token id: for the audit trail) and the
    pending action the client's confirmation names, if any."""

    customer_id: str
    session_id: str
    client: dict = field(default_factory=dict)
    action_id: str | None = None


class _Customer:
    """One customer's bank view with the lookup, classifier and policy built over it; rebuilt when the
    customer's payee version moves."""

    def __init__(self, view: CustomerBank, policy: Policy, threshold: float):
        self.view = view
        self.version = view.version
        self.index = _TimedIndex(PayeeIndex(view))
        self.classifier = IntentClassifier(self.index, threshold=threshold)
        self.policy = policy
        # A bare "twenty" is in the customer's own money: their main account's currency.
        accounts = view.accounts()
        self.currency = accounts[0]["currency"] if accounts else "USD"


@dataclass
class Heard:
    """What the audio front end produced for one utterance."""

    text: str
    confidence: float | None = None
    recognizer: str = ""
    audio_s: float = 0.0
    partials: list[str] = field(default_factory=list)
    error: str | None = None  # why the recogniser gave no text (gemma: a timeout or a failed request)
    details: dict[str, Any] = field(default_factory=dict)  # recogniser-specific, for the audit trail


@dataclass
class TurnResult:
    session_id: str
    intent: str
    confidence: float
    entities: dict[str, Any]
    candidates: list[dict[str, Any]]
    needs_confirmation: bool
    executed: bool
    path: str  # 'fast' | 'gemma'
    reply: str
    pending: dict[str, Any] | None = None  # awaiting a yes: {action_id, kind, expires_at}; name it to confirm
    needs_llm: bool = False  # the fast path was unsure (without a model, the policy asked instead)
    transcript: str | None = None
    normalized: str | None = None
    refused: str | None = None
    action: dict[str, Any] | None = None
    stages: dict[str, float] = field(default_factory=dict)
    timeline: dict[str, float] = field(default_factory=dict)
    asr: dict[str, Any] | None = None
    llm: dict[str, Any] | None = None
    documents: list[str] | None = None  # knowledge-base ids behind a qna reply

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


class _TimedIndex:
    """A PayeeIndex that adds the time spent in its searches to the turn's ``lookup`` stage.

    The classifier runs the lookup inside ``classify``; timing through this proxy reports lookup and
    intent separately without looking up twice. The time is per thread: turns of one customer's sessions
    may classify at once."""

    def __init__(self, index: PayeeIndex):
        self._index = index
        self._spent = threading.local()

    @property
    def spent_s(self) -> float:
        return getattr(self._spent, "s", 0.0)

    @spent_s.setter
    def spent_s(self, value: float) -> None:
        self._spent.s = value

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._index, name)
        if name not in ("search", "find_in_utterance") or not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.spent_s += time.perf_counter() - start

        return timed


class Assistant:
    """The banking assistant: deterministic core, audio front end and optional Gemma, behind ``turn``.

    It serves many customers of one ``BankBackend``: each turn names its ``Caller`` (customer, session,
    client), and every lookup, decision and audit row is that customer's. Money never moves here:
    ``Policy`` decides, and it executes a transfer only on a confirmation turn that names the action.
    Bank and policy work runs in worker threads (a bank behind HTTP must not stall the event loop);
    audio decoding, VAD and ASR, which take tens to hundreds of ms, run on one audio thread
    (``in_audio_thread``) and touch no bank.
    """

    def __init__(
        self,
        bank: BankBackend,
        engine=None,
        *,
        audit: AuditLog | None = None,
        state: StateStore | None = None,
        recognizer: Any = "pocketsphinx",
        limits_minor: dict | None = None,
        intent_threshold: float = 0.75,
        extraction_max_tokens: int | None = 96,
        metrics: AssistantMetrics | None = None,
        vad_min_silence_ms: int = 500,
        max_cached_customers: int = 1024,
        max_cached_recognizers: int = 8,
    ):
        self.bank = bank
        if state is not None and audit is not None:
            raise ValueError("give audit or state, not both: a state store keeps its own audit trail")
        # Sessions, dialogue states and the audit trail: in this process, or (``state``) in a database that
        # every replica shares, so that any of them can take any turn.
        self.state = state
        self.audit = state.audit if state is not None else audit if audit is not None else AuditLog()
        self.sessions: ConversationStore = state.conversations if state is not None else SessionStore()
        # Cancels the proposals no yes can reach any more (the app runs it in the background).
        self.sweeper = ProposalSweeper(self.sessions, bank, self.audit)
        self.engine = engine
        self.metrics = metrics or AssistantMetrics()
        self.limits_minor = limits_minor
        self.intent_threshold = intent_threshold
        self.knowledge = KnowledgeIndex()
        self.vad_min_silence_ms = vad_min_silence_ms
        self._recognizer_spec = recognizer
        # Per customer: lookup, classifier and policy (cheap), and the recogniser biased to their payees
        # (a language model each: tens of ms to build, so fewer are kept).
        self._customers: OrderedDict[str, _Customer] = OrderedDict()
        self._recognizers: OrderedDict[str, tuple[int, Any]] = OrderedDict()
        self._max_customers = max_cached_customers
        self._max_recognizers = max_cached_recognizers
        self._cache_lock = threading.Lock()
        self._session_locks: dict[str, list] = {}
        self._customer_locks: dict[str, list] = {}  # _customer_decision's
        # All audio work (decoding, VAD, ASR) runs on this one thread. Why one: torch calls from several
        # threads each start their own OpenMP team, whose spinning workers starve one another on a small
        # CPU (measured: streaming VAD went from ~0.1 s to 2-4 s per utterance once two threads used it).
        self._audio_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="g4-assistant-audio")
        self.extractor = None
        if engine is not None:
            from g4serve_assistant.extraction import Extractor

            self.extractor = Extractor(engine, max_tokens=extraction_max_tokens)

    # ---- components that follow the customer's records ----------------------------------------------
    def customer(self, customer_id: str) -> _Customer:
        """The customer's view, lookup and policy (UnknownCustomerError when the bank has no such one)."""
        with self._cache_lock:
            cached = self._customers.get(customer_id)
            if cached is not None:
                self._customers.move_to_end(customer_id)
        if cached is not None and cached.view.version == cached.version:
            return cached
        view = self.bank.customer(customer_id)
        policy = Policy(view, limits_minor=self.limits_minor, claims=self.sessions)
        built = _Customer(view, policy, self.intent_threshold)
        with self._cache_lock:
            self._customers[customer_id] = built
            while len(self._customers) > self._max_customers:
                self._customers.popitem(last=False)
        return built

    def recognizer(self, customer_id: str) -> Any:
        """The speech recogniser biased to this customer's payees, rebuilt when they changed."""
        from g4serve_assistant.asr import make_recognizer
        from g4serve_assistant.vocabulary import DomainVocabulary

        customer = self.customer(customer_id)  # reads the payee version once (a GET for a remote bank)
        view, version = customer.view, customer.version
        spec = self._recognizer_spec
        key = customer_id if isinstance(spec, str) else "*"  # a given object serves everyone
        with self._cache_lock:
            cached = self._recognizers.get(key)
            if cached is not None:
                self._recognizers.move_to_end(key)
        if cached is not None and cached[0] == (customer_id, version):
            return cached[1]
        payees = view.payees()
        vocab = DomainVocabulary.build(
            [p.display_name for p in payees],
            version=version,
            aliases=[a for p in payees for a in getattr(p, "aliases", ())],
        )
        if isinstance(spec, str):
            recognizer = cached[1] if cached is not None else make_recognizer(spec, vocab, engine=self.engine)
            if cached is not None:
                recognizer.update_vocabulary(vocab)
        else:
            recognizer = spec
            recognizer.update_vocabulary(vocab)
        with self._cache_lock:
            self._recognizers[key] = ((customer_id, version), recognizer)
            while len(self._recognizers) > self._max_recognizers:
                self._recognizers.popitem(last=False)
        return recognizer

    def vad(self):
        from g4serve_assistant.vad import VoiceActivityDetector

        return VoiceActivityDetector(min_silence_ms=self.vad_min_silence_ms)

    async def in_audio_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the assistant's audio thread (see ``__init__`` for why there is one)."""
        return await asyncio.get_running_loop().run_in_executor(self._audio_thread, fn, *args)

    def close(self) -> None:
        self._audio_thread.shutdown(wait=False, cancel_futures=True)

    async def warmup(self, audio: bool = True) -> None:
        """Load the VAD and ASR models (``audio``) and compile the extraction grammars before the first
        turn."""
        if audio:
            from g4serve_assistant.asr import make_recognizer
            from g4serve_assistant.vocabulary import DomainVocabulary

            # No customer yet: the intent vocabulary alone loads the acoustic model and the VAD once.
            spec = self._recognizer_spec
            vocab = DomainVocabulary.build([], version=0, aliases=[])
            silence = np.zeros(SAMPLE_RATE // 2, dtype=np.float32)

            def load() -> None:
                self.vad().trim(silence)
                if isinstance(spec, str):
                    make_recognizer(spec, vocab, engine=self.engine).transcribe(silence)

            await self.in_audio_thread(load)
        if self.extractor is not None:
            await self.extractor.warmup()

    # ---- audio front end (worker thread) ---------------------------------------------------------------
    def hear(self, audio: bytes | np.ndarray, clock: StageClock, recognizer: Any) -> Heard:
        """Whole recording -> transcript: decode (bytes: WAV), trim with VAD, stream through the recogniser.

        Raises AudioError for audio that cannot be decoded; returns empty text when there is no speech."""
        clock.mark("audio_received", clock.t0)
        if isinstance(audio, (bytes, bytearray, memoryview)):
            with clock.stage("decode"):
                samples = decode_wav(bytes(audio))
        else:
            samples = np.asarray(audio, dtype=np.float32).reshape(-1)
            if samples.size > MAX_UTTERANCE_S * SAMPLE_RATE:  # decode_wav refuses longer WAVs the same way
                seconds = samples.size / SAMPLE_RATE
                raise AudioError(f"audio: {seconds:.1f} s is longer than the {MAX_UTTERANCE_S:g} s limit")
        with clock.stage("vad"):
            speech = self.vad().trim(samples) if samples.size else None
        clock.mark("vad_end")
        if speech is None or speech.size == 0:
            return Heard(text="", audio_s=samples.size / SAMPLE_RATE)
        stream = recognizer.stream()
        start = time.perf_counter()
        step = int(_ASR_CHUNK_S * SAMPLE_RATE)
        for i in range(0, speech.size, step):
            if stream.feed(speech[i : i + step]) is not None and "asr_partial" not in clock.stages:
                clock.add("asr_partial", (time.perf_counter() - start) * 1000)
                clock.mark("asr_partial")
        transcript = stream.finish()
        clock.add("asr_final", (time.perf_counter() - start) * 1000)
        clock.mark("asr_final")
        return Heard(
            text=transcript.text,
            confidence=transcript.confidence,
            recognizer=transcript.recognizer,
            audio_s=samples.size / SAMPLE_RATE,
            partials=list(transcript.partials),
            error=transcript.error,
            details=dict(transcript.details),
        )

    def listen(self, customer_id: str) -> Utterance:
        """A streaming utterance (for the WebSocket): feed PCM chunks, get VAD/partial events."""
        return Utterance(self.vad(), self.recognizer(customer_id))

    # ---- a turn --------------------------------------------------------------------------------------------
    async def turn(
        self,
        caller: Caller,
        text: str | None = None,
        audio: bytes | np.ndarray | None = None,
        clock: StageClock | None = None,
    ) -> TurnResult:
        """One turn from text or audio (WAV bytes or float32 16 kHz samples).

        ``clock``: the caller's, when the turn began before this call (the server decoding base64 audio)."""
        if (text is None) == (audio is None):
            raise ValueError("give exactly one of text and audio")
        clock = clock or StageClock()
        heard = None
        if audio is not None:
            recognizer = await asyncio.to_thread(self.recognizer, caller.customer_id)
            heard = await self.in_audio_thread(self.hear, audio, clock, recognizer)
            text = heard.text
        return await self.decide(caller, text or "", clock, heard)

    async def decide(
        self, caller: Caller, text: str, clock: StageClock, heard: Heard | None = None
    ) -> TurnResult:
        """Text (typed or transcribed) -> decision; serialized per session so a confirmation cannot race."""
        async with self._session_turn(caller.session_id):
            result = await self._decide(caller, text, clock, heard)
        end = clock.mark("response_sent")
        result.stages["total"] = round((end - clock.t0) * 1000, 3)
        if "vad_end" in clock.timeline:
            # What a speaker waits for: from the end of their speech to the answer.
            result.stages["after_vad_end"] = round(
                clock.timeline["response_sent"] - clock.timeline["vad_end"], 3
            )
        result.timeline = dict(clock.timeline)
        self.metrics.observe_turn(
            result.intent,
            result.path,
            result.stages,
            result.executed,
            result.refused,
            llm_failed=bool(result.llm and not result.llm.get("valid")),
        )
        return result

    def _session_turn(self, session_id: str):
        """One turn (or logout) of a session at a time in this process (a shared store's lease does it
        across replicas)."""
        return _held(self._session_locks, session_id)

    def _customer_decision(self, customer_id: str):
        """One decision (or logout) of a customer at a time in this process, held through its bank calls and
        waited for on the event loop. One lock for all customers let one customer's hanging bank call hold
        up every other customer's turn; a lock waited for in a worker thread let a few sessions of one
        customer behind it fill the default pool (6 threads on 2 cores), and every other customer's turn
        queued behind them. (A rebuilt policy, its records changed, is serialised with the old one here.)"""
        return _held(self._customer_locks, customer_id)

    async def end_session(self, caller: Caller) -> None:
        """Logout: cancels the session's pending action in the bank (as a replacing request does) and forgets
        its dialogue state; the cancellation is audited. BankUnavailableError leaves both as they were."""
        async with self._session_turn(caller.session_id), self._customer_decision(caller.customer_id):
            rows = await asyncio.to_thread(self._end, caller)
        if rows:
            await asyncio.to_thread(self.record, caller, rows)

    def _end(self, caller: Caller) -> list[AuditRow]:
        try:
            customer = self.customer(caller.customer_id)
        except UnknownCustomerError:  # gone from the bank: no view to cancel in, nothing that could execute
            self.sessions.drop(caller.session_id)
            return []
        session = self.sessions.begin(caller.session_id, caller.customer_id)
        try:
            rows = customer.policy.end(session)
        except BaseException:
            self.sessions.release(session)
            raise
        self.sessions.commit(session)
        self.sessions.drop(caller.session_id)
        return rows

    def record(self, caller: Caller, rows: list[AuditRow]) -> None:
        """Appends one attempt's rows to the audit trail under the caller's customer, session and client."""
        self.audit.append(
            rows, customer_id=caller.customer_id, session_id=caller.session_id, client=caller.client
        )

    async def record_to_end(self, caller: Caller, rows: list[AuditRow]) -> None:
        """``record`` in a worker thread that runs to its end even if the caller is cancelled meanwhile: a
        stream whose client left is cancelled again at each await (anyio's cancel scope), and a plain
        ``to_thread`` then dropped the write whenever no worker thread had started it yet."""
        await run_to_end(asyncio.to_thread(self.record, caller, rows))

    def _understand(self, caller: Caller, text: str, clock: StageClock):
        """Normalize and classify on the customer's records (a worker thread: the bank may be remote)."""
        customer = self.customer(caller.customer_id)
        # From here until commit or release the session's state is this turn's alone (in a shared store,
        # on whichever replica: the others' turns of this session wait).
        session = self.sessions.begin(caller.session_id, caller.customer_id)
        try:
            with clock.stage("normalize"):
                normalized = normalize(text, default_currency=customer.currency)
            customer.index.spent_s = 0.0
            with clock.stage("intent"):
                result = customer.classifier.classify(normalized)
        except BaseException:
            self.sessions.release(session)
            raise
        lookup_ms = customer.index.spent_s * 1000
        clock.add("lookup", lookup_ms)
        clock.add("intent", -lookup_ms)
        return customer, session, normalized, result

    async def _decide(self, caller: Caller, text: str, clock: StageClock, heard: Heard | None) -> TurnResult:
        asr = None
        audit: list[AuditRow] = []  # the whole turn is appended at once, the policy's rows included
        if heard is not None:
            asr = {
                "recognizer": heard.recognizer,
                "confidence": heard.confidence,
                "audio_s": round(heard.audio_s, 3),
                "partials": heard.partials,
            }
            detail = {"text": heard.text, **asr, "error": heard.error, "details": _jsonable(heard.details)}
            audit.append(AuditRow("asr", "transcript", detail))
        if not text.strip():
            audit.append(
                AuditRow(
                    "turn",
                    "not_heard",
                    {"reply": NOT_HEARD_REPLY, "stages": dict(clock.stages)},
                    outcome="not_heard",
                )
            )
            await asyncio.to_thread(self.record, caller, audit)
            return TurnResult(
                session_id=caller.session_id,
                intent="unknown",
                confidence=0.0,
                entities={},
                candidates=[],
                needs_confirmation=False,
                executed=False,
                path="fast",
                reply=NOT_HEARD_REPLY,
                transcript=text if heard is not None else None,
                stages=dict(clock.stages),
                asr=asr,
            )
        # Run to its end even if this turn is cancelled meanwhile: the session it takes is then let go.
        async with self._audit_if_cut(caller, audit, clock):
            customer, session, normalized, result = await run_to_end(
                asyncio.to_thread(self._understand, caller, text, clock),
                undo=lambda understood: self.sessions.release(understood[1]),
            )
        try:
            audit.append(
                AuditRow(
                    "normalize",
                    "rules",
                    {
                        "original": normalized.original,
                        "text": normalized.text,
                        "rules": [_jsonable(dataclasses.asdict(r)) for r in normalized.rules],
                    },
                )
            )
            path, llm_info = "fast", None
            candidates = list(result.candidates or [])
            # The policy says when the model may look: never at a yes/no or at an answer to its own question.
            # Without a model (or when its output does not validate) the policy asks the clarifying question.
            needs_llm = customer.policy.wants_llm(session, result)
            if self.extractor is not None and needs_llm:
                path = "gemma"
                async with self._audit_if_cut(caller, audit, clock):
                    result, llm_info = await self._extract(
                        customer, text, normalized, result, candidates, clock, audit
                    )
        except BaseException:
            await asyncio.to_thread(self.sessions.release, session)  # the state stays as it was
            raise
        # From the decision on, the turn runs to its end even if it is cancelled (a server stopping, a socket
        # closed): a yes may move money inside the bank, and the state it leaves and its audit rows must
        # follow it, not a release of the session as it was.
        decision, reply, documents = await run_to_end(
            self._conclude(caller, customer, session, normalized.text, result, clock, audit, path)
        )
        return TurnResult(
            session_id=caller.session_id,
            intent=decision.intent,
            confidence=round(float(result.confidence or 0.0), 4),
            entities=_jsonable(dict(result.entities or {})),
            candidates=[_candidate(c) for c in candidates],
            needs_confirmation=bool(decision.needs_confirmation),
            executed=bool(decision.executed),
            path=path,
            reply=reply,
            pending=decision.pending,
            needs_llm=needs_llm,
            transcript=text if heard is not None else None,
            normalized=normalized.text,
            refused=decision.refused,
            action=_jsonable(decision.action),
            stages=dict(clock.stages),
            asr=asr,
            llm=llm_info,
            documents=documents,
        )

    async def _conclude(
        self,
        caller: Caller,
        customer: _Customer,
        session,
        text: str,
        result,
        clock: StageClock,
        audit: list[AuditRow],
        path: str,
    ) -> tuple[Any, str, list[str] | None]:
        """The policy's decision on the turn's ``result``, the session's state written back, and the whole
        turn's audit rows recorded: (decision, reply, the QnA documents)."""
        documents = None
        try:
            with clock.stage("policy"):
                async with self._customer_decision(caller.customer_id):
                    decision = await asyncio.to_thread(
                        customer.policy.decide, session, result, text, caller.action_id
                    )
                reply = decision.reply
                if decision.intent == "qna":
                    hits = self.knowledge.search(text)
                    documents = [h.document.doc_id for h in hits]
                    reply = _with_answer(reply, extractive_answer(hits))
        except BaseException:
            await asyncio.to_thread(self.sessions.release, session)  # the state stays as it was
            raise
        written = await asyncio.to_thread(self.sessions.commit, session)
        audit.extend(decision.audit)
        if not written:
            # This turn outlived its lease and another turn took the session over: that turn's state
            # stands. What this one did is real (an execution is claimed first), and audited.
            log.warning("session %s: state not written back (lease lapsed)", caller.session_id)
            audit.append(AuditRow("turn", "state_not_written", {"reason": "lease lapsed"}))
        audit.append(
            AuditRow(
                "turn",
                path,
                {
                    "intent": decision.intent,
                    "reply": reply,
                    "documents": documents,
                    "stages": dict(clock.stages),
                },
                outcome=decision.audit[-1].outcome if decision.audit else None,
            )
        )
        await asyncio.to_thread(self.record, caller, audit)
        return decision, reply, documents

    @contextlib.asynccontextmanager
    async def _audit_if_cut(self, caller: Caller, audit: list[AuditRow], clock: StageClock):
        """A turn cancelled before its decision (its client gone, the server stopping) still leaves what it
        did in the audit (what was heard and understood), and a ``turn``/``cut`` row with its stages so far:
        written to its end whatever cancels it again."""
        try:
            yield
        except asyncio.CancelledError:
            audit.append(AuditRow("turn", "cut", {"stages": dict(clock.stages)}, outcome="cancelled"))
            await self.record_to_end(caller, audit)
            raise

    async def _extract(
        self,
        customer: _Customer,
        text: str,
        normalized,
        result,
        candidates: list,
        clock: StageClock,
        audit: list[AuditRow],
    ):
        """Gemma extraction; returns the result for the policy and what the call did (for the response)."""
        from g4serve_assistant.extraction import MAX_CANDIDATES, merge_into_result

        offered = candidates[:MAX_CANDIDATES]
        extraction = await self.extractor.extract(
            text, offered, normalized=normalized.text, heard=normalized.amounts
        )
        clock.add("llm", extraction.llm_ms)
        clock.mark("llm_start", extraction.timeline["llm_start"])
        clock.mark("llm_end", extraction.timeline["llm_end"])
        clock.add("validation", extraction.validation_ms)
        clock.mark("validation")
        info = {
            "valid": extraction.valid,
            "error": extraction.error,
            "output": extraction.output,
            "offered": extraction.offered,
            "prompt_tokens": extraction.prompt_tokens,
            "cached_tokens": extraction.cached_tokens,
            "output_tokens": extraction.output_tokens,
            "decoded_tokens": extraction.decoded_tokens,
            "forced_tokens": extraction.forced_tokens,
            "finish_reason": extraction.finish_reason,
        }
        audit.append(AuditRow("llm", "extraction", {**info, "raw": extraction.raw}))
        if not extraction.valid:
            return result, info  # the fast path's reading goes to the policy, which asks rather than guesses
        merged = merge_into_result(result, extraction, offered)
        merged.entities = await asyncio.to_thread(_resolve_references, customer.view, merged.entities)
        return merged, info


class Utterance:
    """Streaming audio of one connection: VAD end-pointing plus a recogniser stream opened at speech start.

    Audio before speech is kept in a short pre-roll buffer, and what of it lies within ``_PREROLL_S`` of the
    VAD's start is handed to the recogniser when VAD fires (VAD reports the start a window or two late);
    silence is never decoded, so noise between utterances cannot turn into words. Every sample the
    recogniser gets, pre-roll included, counts against ``max_utterance_s``, however the audio was chunked.
    Not thread-safe: one per connection, fed from one task.
    """

    _PREROLL_S = 0.5

    def __init__(self, vad, recognizer, max_utterance_s: float = MAX_UTTERANCE_S):
        self._vad = vad
        self.max_utterance_s = max_utterance_s
        self._recognizer = recognizer
        self._preroll: deque[np.ndarray] = deque()
        self._preroll_samples = 0
        self.reset()

    def reset(self) -> None:
        self._vad.reset()
        self._stream = None
        self._preroll.clear()
        self._preroll_samples = 0
        self._fed_samples = 0  # since the reset: the VAD's stream clock, in samples
        self.clock: StageClock | None = None
        self._speech_start: float | None = None
        self._speech_samples = 0
        self.ended = False

    @property
    def in_speech(self) -> bool:
        return self._stream is not None

    def _trim_preroll(self) -> None:
        """Keep the last ``_PREROLL_S`` seconds of audio before speech starts (slicing a long chunk)."""
        keep = int(self._PREROLL_S * SAMPLE_RATE)
        while self._preroll and self._preroll_samples - self._preroll[0].size >= keep:
            self._preroll_samples -= self._preroll.popleft().size
        excess = self._preroll_samples - keep
        if excess > 0:  # a copy, so a long chunk's buffer is not kept alive by a view of its tail
            self._preroll[0] = self._preroll[0][excess:].copy()
            self._preroll_samples = keep

    def _speech_from(self, start_s: float) -> np.ndarray:
        """The buffered audio from ``_PREROLL_S`` before the VAD's start on (its chunk included)."""
        pending = np.concatenate(list(self._preroll)) if self._preroll else np.zeros(0, np.float32)
        first = self._fed_samples - pending.size  # stream position of the buffer's first sample
        begin = round((start_s - self._PREROLL_S) * SAMPLE_RATE) - first
        self._preroll.clear()
        self._preroll_samples = 0
        return pending[max(0, begin) :]

    def feed(self, pcm: np.ndarray) -> list[dict]:
        """Events for the client: ``{"type": "vad", "event": ...}`` and ``{"type": "partial", "text": ...}``.

        After a VAD ``end`` (or the cap) the caller should call ``finish``; audio after it is dropped."""
        if self.ended:
            return []
        if self.clock is None:
            self.clock = StageClock()  # turn time starts at the utterance's first audio
            self.clock.mark("audio_received")
        events: list[dict] = []
        t_vad = time.perf_counter()
        vad_events = self._vad.feed(pcm)
        self.clock.add("vad", (time.perf_counter() - t_vad) * 1000)
        self._fed_samples += pcm.size
        was_speech = self._stream is not None
        if not was_speech:
            self._preroll.append(pcm)
            self._preroll_samples += pcm.size
        for event in vad_events:
            events.append({"type": "vad", "event": event.kind, "t_s": round(event.t_s, 3)})
            if event.kind == "start" and self._stream is None:
                self._stream = self._recognizer.stream()
                self._speech_start = time.perf_counter()
                self.clock.mark("vad_start")
                events += self._asr(self._speech_from(event.t_s))  # this chunk's speech included
            elif event.kind == "end" and self._stream is not None:
                self.clock.mark("vad_end")
                self.ended = True
            if self.ended:
                return events
        if self._stream is None:
            self._trim_preroll()
        elif was_speech:
            events += self._asr(pcm)
        return events

    def _asr(self, pcm: np.ndarray) -> list[dict]:
        """Hands audio to the recogniser, ``max_utterance_s`` in all at most; reaching it ends the utterance.

        Counted here, where every sample passes: the pre-roll used to go uncounted, so one 90 s WebSocket
        frame (VAD fired in it: all of it was pre-roll) was decoded whole, ~12 s of the audio thread that
        every customer's speech waits for. The 30 s cap takes ~3 s (pocketsphinx, one core)."""
        room = int(self.max_utterance_s * SAMPLE_RATE) - self._speech_samples
        pcm = pcm[: max(0, room)]
        self._speech_samples += pcm.size
        events: list[dict] = []
        partial = self._stream.feed(pcm) if pcm.size else None
        if partial is not None:
            if "asr_partial" not in self.clock.stages:
                self.clock.add("asr_partial", (time.perf_counter() - self._speech_start) * 1000)
                self.clock.mark("asr_partial")
            events.append({"type": "partial", "text": partial})
        if pcm.size == room:
            # Endless "speech" (music, a stuck microphone) would grow the decode forever: end it here.
            self.clock.mark("vad_end")
            self.ended = True
            events.append({"type": "vad", "event": "end", "reason": "max_utterance_s"})
        return events

    def finish(self) -> tuple[Heard, StageClock]:
        """End the utterance (VAD end or the client's ``end``): final transcript and the clock so far."""
        clock = self.clock or StageClock()
        if self._stream is None:
            heard = Heard(text="")
        else:
            start = time.perf_counter()
            if "vad_end" not in clock.timeline:
                clock.mark("vad_end", start)  # the client ended the utterance
            transcript = self._stream.finish()
            clock.add("asr_final", (time.perf_counter() - start) * 1000)
            clock.mark("asr_final")
            heard = Heard(
                text=transcript.text,
                confidence=transcript.confidence,
                recognizer=transcript.recognizer,
                audio_s=transcript.audio_s,
                partials=list(transcript.partials),
                error=transcript.error,
                details=dict(transcript.details),
            )
        self._stream = None
        self.reset()
        return heard, clock


_POLICY_QNA_FALLBACK = "Let me look that up for you."


@asynccontextmanager
async def _held(locks: dict[str, list], key: str) -> AsyncIterator[None]:
    """``key``'s asyncio lock in ``locks``, made on first use and dropped once nobody holds or waits for it
    (one lock per session or customer ever seen would never be freed)."""
    entry = locks.setdefault(key, [asyncio.Lock(), 0])  # [lock, turns using it]
    entry[1] += 1
    try:
        async with entry[0]:
            yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del locks[key]


def _with_answer(policy_reply: str, answer: str) -> str:
    """The knowledge-base answer in place of the policy's placeholder, keeping any reminder it appended."""
    if policy_reply.startswith(_POLICY_QNA_FALLBACK):
        return (answer + policy_reply[len(_POLICY_QNA_FALLBACK) :]).strip()
    return f"{answer} {policy_reply}".strip()


def _candidate(c) -> dict[str, Any]:
    return {
        "id": c.payee_id,
        "name": c.display_name,
        "score": round(float(c.score), 1),
        "relationship": c.relationship,
        "kind": c.kind,
        "phonetic": bool(c.phonetic),
    }


def _jsonable(value: Any) -> Any:
    """Dates, tuples, sets and dataclasses made JSON-friendly (entities and actions come from the core)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (dt.date, dt.datetime, dt.time)):
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, np.generic):
        return value.item()
    return value


def _resolve_references(view: CustomerBank, entities: dict) -> dict:
    """Card and account words from the model ("debit", "savings") as the database ids the policy acts on;
    a word that names nothing is dropped rather than passed on."""
    entities = dict(entities)
    card = entities.get("card")
    if isinstance(card, str):
        cards = view.cards()
        if card not in {c["card_id"] for c in cards}:
            word = card.strip().lower()
            match = next((c["card_id"] for c in cards if word in (c["kind"], c["network"])), None)
            entities.pop("card") if match is None else entities.__setitem__("card", match)
    account = entities.get("account")
    if isinstance(account, str):
        accounts = view.accounts()
        if account not in {a["account_id"] for a in accounts}:
            word = account.strip().lower()
            match = next(
                (a["account_id"] for a in accounts if word in (a["name"], a["currency"].lower())), None
            )
            entities.pop("account") if match is None else entities.__setitem__("account", match)
    return entities
