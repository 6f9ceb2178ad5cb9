"""One generation request: its inputs, the tokens and text produced so far, and when it stops."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from g4serve.outputs import CompletionOutput, Logprob, RequestMetrics
from g4serve.processing.processor import MultimodalItem, bidirectional_spans
from g4serve.processing.tokenizer import IncrementalDetokenizer, Tokenizer
from g4serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from g4serve.engine.inputs import DeviceDrafts
    from g4serve.structured import StructuredMatcher


MAX_CACHE_SALT_CHARS = 1024


def check_unicode(text: str, field: str) -> None:
    """``ValueError`` naming ``field`` where ``text`` holds a lone surrogate (JSON's "\\ud800" decodes to
    one), which is no character: no tokenizer or digest can encode it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            message = f"{field}: invalid Unicode at character {exc.start} (a lone surrogate)"
            raise ValueError(message) from None


def check_cache_salt(value: object) -> str:
    """A prompt's ``cache_salt`` as given, or ``ValueError`` naming the field. vLLM asks for a non-empty
    string; a random one of 256 bits (43 base64 characters) is what makes another tenant's guess useless."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"cache_salt: must be a non-empty string, got {type(value).__name__} {value!r:.40}")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt: {len(value)} characters, more than {MAX_CACHE_SALT_CHARS}")
    check_unicode(value, "cache_salt")
    return value


def salt_digest(salt: str | None) -> bytes:
    """What a request's first block digest chains from: nothing without a salt (unsalted requests share with
    each other), else a fixed-length digest of it, so no salt and no adapter suffix can spell another's."""
    if salt is None:
        return b""
    return hashlib.blake2b(salt.encode("utf-8"), digest_size=16, person=b"g4serve-salt").digest()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: requests are compared in batch lists every step
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    tokenizer: Tokenizer
    prompt: str | None = None
    mm_items: list[MultimodalItem] = field(default_factory=list)
    max_total_tokens: int = 1 << 30  # context limit: prompt + output
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Constrained decoding: the grammar state of sampling_params.structured_output (set by the engine).
    grammar: StructuredMatcher | None = None
    # Jump-forward (EngineConfig.jump_forward): text the grammar forces becomes output tokens at once.
    jump_forward: bool = False
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # The prefix-cache salt: its first block's digest chains from it, so its KV blocks are shared only with
    # requests of the same salt (the client's ``cache_salt`` and its adapter's uid, set by the engine).
    cache_salt: bytes = b""

    def __post_init__(self) -> None:
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if self.sampling_params.logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        self.num_forced_tokens = 0  # outputs appended by jump-forward, not sampled (they count as outputs)
        self._untimed_tokens = 0  # forced before the first sample: they reach the client with it
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why the engine failed it (finish_reason "error")
        self.error_status = 500  # 400: the client's input caused it (a grammar with no way on)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.num_computed_tokens = (
            0  # tokens whose K/V are in the cache (or being written by a launched step)
        )
        # Async scheduling: tokens sampled by a launched step that the host has not read yet (0 or 1). They
        # count in num_tokens, so the next step can be scheduled (its input token is fed on the device).
        self.num_pending_outputs = 0
        self.bidirectional_spans = sorted(bidirectional_spans(self.mm_items))
        self.block_hashes: list[bytes] = []  # prefix-cache digests of the full blocks so far
        self.lora_slot = -1  # its adapter's slot while it holds one (set by the engine)
        # Speculative decoding: tokens proposed for the next step to verify, and those the launched step
        # verifies (engine/speculative.py). Drafts left on the device (``set_device_drafts``) are placeholders
        # here until the verifying step's read-back; ``*_source`` says where their values are.
        self.draft_token_ids: list[int] = []
        self.draft_source: tuple[DeviceDrafts, int] | None = None
        self.verifying: list[int] = []
        self.verifying_source: tuple[DeviceDrafts, int] | None = None
        self.pinned_media: set[str] = set()  # encoder-cache entries this request still needs
        self._detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=self.sampling_params.skip_special_tokens
        )
        self._stop_tokens = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            self._stop_tokens.update(self.eos_token_ids)
        self._max_stop_len = max((len(s) for s in self.sampling_params.stop), default=0)
        self._streamed_chars = 0
        self._streamed_tokens = 0

    def set_drafts(self, tokens: list[int]) -> None:
        """Drafts for the next step to verify, on the host."""
        self.draft_token_ids, self.draft_source = list(tokens), None

    def set_device_drafts(self, drafts: DeviceDrafts, index: int, count: int) -> None:
        """``count`` drafts for the next step, in row ``index`` of a round still on the device."""
        self.draft_token_ids, self.draft_source = [0] * count, (drafts, index)

    def take_verifying(self) -> list[int]:
        """The drafts the launched step verified (values copied back from the device if they were left
        there, the step having been read back), clearing them."""
        verifying, self.verifying = self.verifying, []
        source, self.verifying_source = self.verifying_source, None
        if source is None or not verifying:
            return verifying
        return source[0].row(source[1], len(verifying))

    @property
    def stop_token_ids(self) -> set[int]:
        """Token ids that end this request (EOS unless ignore_eos, plus stop_token_ids)."""
        return self._stop_tokens

    @property
    def min_tokens_pending(self) -> bool:
        return self.num_output_tokens < self.sampling_params.min_tokens

    # ---- sizes -------------------------------------------------------------------------------
    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Known tokens (prompt, then outputs; not the pending ones) in [start, end), without concatenating
        the whole sequence (a decode step reads one)."""
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens to compute, pending outputs included."""
        return self.num_known_tokens + self.num_pending_outputs

    @property
    def num_output_tokens(self) -> int:
        """Outputs sampled so far, pending ones included."""
        return len(self.output_token_ids) + self.num_pending_outputs

    @property
    def awaiting_last_token(self) -> bool:
        """Every output it may produce is sampled, the last one still pending: nothing left to schedule."""
        return self.num_pending_outputs > 0 and self.num_output_tokens >= self.max_output_tokens

    @property
    def max_output_tokens(self) -> int:
        room = self.max_total_tokens - len(self.prompt_token_ids)
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # ---- growth ------------------------------------------------------------------------------
    def append_token(
        self,
        token_id: int,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
        now: float | None = None,
    ) -> None:
        """Record one sampled token and decide whether the request is done."""
        self._record_time(time.monotonic() if now is None else now)
        self._append(token_id, logprob, top)

    def append_forced(self, token_ids: list[int], now: float | None = None) -> None:
        """Record tokens the grammar forced (jump-forward): outputs like sampled ones (max_tokens, stop
        tokens and strings, detokenizing), without logprobs; the ones after a stop are dropped. ``now``
        None: forced at admission, before any sample; they are timed with the first sampled token."""
        for token_id in token_ids:
            if self.finished:
                return
            if now is None:
                self._untimed_tokens += 1
            else:
                self._record_time(now)
            self.num_forced_tokens += 1
            self._append(token_id, None, None)

    @property
    def num_decoded_tokens(self) -> int:
        """Outputs that were sampled (one forward each), as opposed to forced."""
        return len(self.output_token_ids) - self.num_forced_tokens

    def _record_time(self, now: float) -> None:
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.extend([now] * (self._untimed_tokens + 1))
        self._untimed_tokens = 0
        self.metrics.last_token_time = now

    def _append(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        self.output_token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            entry = {token_id: Logprob(logprob, decoded_token=self.tokenizer.token_text(token_id))}
            for rank, (tid, lp) in enumerate(top or [], start=1):
                if tid in entry:
                    entry[tid].rank = rank
                else:
                    entry[tid] = Logprob(lp, rank=rank, decoded_token=self.tokenizer.token_text(tid))
            self.logprobs.append(entry)
            self.cumulative_logprob += logprob
        min_tokens_done = len(self.output_token_ids) >= self.sampling_params.min_tokens
        # With jump-forward the grammar may already stand past this token (on the stop token that ends it):
        # the grammar is done at that stop token, not before.
        grammar_done = (
            self.grammar is not None
            and self.grammar.is_terminated()
            and token_id in self.grammar.vocab.stop_token_ids
        )
        if grammar_done or (token_id in self._stop_tokens and min_tokens_done):
            # A grammar ends on a stop token whatever min_tokens and ignore_eos say: its output is complete.
            self.finish_reason, self.stop_reason = "stop", token_id
            # The stop token itself is not text (vLLM keeps it in token_ids only).
            self.text += self._detok.flush()
            return
        checked = len(self.text)
        self.text += self._detok.add(token_id)
        if self.sampling_params.stop and min_tokens_done and self._check_stop_strings(checked):
            return
        if len(self.output_token_ids) >= self.max_output_tokens:
            self.finish_reason = "length"
            self.text += self._detok.flush()

    def _check_stop_strings(self, checked: int) -> bool:
        # Only a stop string overlapping the new text can be new.
        window_start = max(0, checked - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.sampling_params.stop:
            pos = self.text.find(stop, window_start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        self.text = (
            self.text[: pos + len(stop)]
            if self.sampling_params.include_stop_str_in_output
            else self.text[:pos]
        )
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = "abort"

    def fail(self, error: str, status: int = 500) -> None:
        """End the request because the engine could not run it; ``error`` is the message its client gets,
        ``status`` its HTTP status (500: a fault in its step; 400: the client's input, found only while it
        ran)."""
        if not self.finished:
            self.finish_reason, self.error, self.error_status = "error", error, status

    def take_stream_delta(self) -> str:
        """Text not yet streamed, holding back a tail that could still become a stop string."""
        end = (
            len(self.text)
            if self.finished
            else max(self._streamed_chars, len(self.text) - max(self._max_stop_len - 1, 0))
        )
        delta = self.text[self._streamed_chars : end]
        self._streamed_chars = end
        return delta

    def take_logprob_delta(self) -> list[dict[int, Logprob]] | None:
        """The logprob entries of the output tokens since the previous call (None without logprobs), let go
        of here: the stream's reader keeps what it needs, and a long request with 20 top logprobs would
        otherwise hold ~5 KB of entries a token until it ends (a stream of 16 choices of 128k tokens,
        ~10 GB). ``completion().logprobs`` then holds the entries not taken yet."""
        if self.logprobs is None:
            return None
        taken, self.logprobs = self.logprobs, []
        return taken

    def take_token_delta(self) -> list[int]:
        """Output tokens not yet streamed (a step's sample, or several: drafts accepted, text forced)."""
        delta = self.output_token_ids[self._streamed_tokens :]
        self._streamed_tokens = len(self.output_token_ids)
        return delta

    def completion(self, index: int = 0, copy: bool = True) -> CompletionOutput:
        """This request's output so far; ``copy=False`` shares its live token list (a reader on the engine
        thread, before the next step: one copy per step of a long output is quadratic over the request)."""
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=list(self.output_token_ids) if copy else self.output_token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            num_forced_tokens=self.num_forced_tokens,
        )
