"""Synthetic, seeded benchmark workloads: each builds OpenAI chat requests (text, image, video, audio,
banking extraction with or without a JSON schema, open Q&A) from ``(seed, namespace, index)`` alone, so
two runs with the same flags send byte-identical requests, and no two requests of a run share media
or filler text (the server's prefix and encoder caches cannot hide the work).

Prompt lengths are set in words: ``calibrate`` measures the tokens one filler word costs with the
target's tokenizer (two probe prompts), so a 512-token extraction prompt is ~512 tokens on g4serve's
tiny tokenizer and on Gemma's real one alike. The server's ``usage`` gives the exact counts.
"""

from __future__ import annotations

import base64
import io
import json
import random
import wave
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Common English words: most are one token in Gemma's tokenizer (the tiny one splits many).
WORD_POOL = """
the of and to in is was for on that with as by at from it be this are have or not but an they which
one you were all we her she there their has been would will more if no when what so about out up into
than them can only other new some time could these two may first then do any like my now over such our
man me even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men work
long get here between both life being under never day same another know while last might us great old
year off come since against go came right used take three bank account money pay payment transfer send
balance savings checking card loan interest rate month week today tomorrow morning evening monday friday
bill rent deposit credit debit amount total fee branch online mobile app customer service statement
history recent address phone number city street market store coffee lunch dinner train ticket hotel
travel insurance water electricity internet school book music garden house family friend brother sister
mother father child children doctor office meeting project report team plan idea question answer reason
example result change order price value small large early late quick slow bright cold warm happy simple
""".split()  # noqa: SIM905 - a paragraph reads better than 250 quoted words

FIRST_NAMES = """Maria James Aisha Wei Carlos Fatima John Priya Lukas Sofia Ahmed Emma Kenji Olivia Mateo
Chloe Daniel Amara Noah Elena Omar Grace Ivan Lucia Samuel Hana Diego Nora Victor Leila""".split()  # noqa: SIM905
LAST_NAMES = """Lopez Smith Khan Chen Garcia Ali Brown Patel Muller Rossi Hassan Johnson Tanaka Williams
Fernandez Martin Davis Okafor Wilson Petrova Haddad Taylor Ivanov Romero Clark Sato Torres Berg Nguyen
Silva""".split()  # noqa: SIM905
BILLERS = [
    "electricity",
    "water",
    "internet",
    "phone",
    "rent",
    "credit card",
    "insurance",
    "gas",
    "gym",
    "school",
]
WHEN = [
    "today",
    "tomorrow",
    "on Friday",
    "next Monday",
    "on the 1st",
    "at the end of the month",
    "in two days",
    "this evening",
    "next week",
    "on March 12",
]
ACCOUNTS = ["checking", "savings", "joint", "business", "travel"]
COMMANDS = [
    "send {amount} dollars to {name} {when}",
    "pay my {biller} bill of {amount} dollars {when}",
    "transfer {amount} dollars from {account} to {account2} {when}",
    "schedule a payment of {amount} dollars to {name} {when}",
    "what is the balance of my {account} account",
    "pay {name} back {amount} dollars for dinner {when}",
    "move {amount} dollars into {account} {when}",
    "cancel the payment to {name} scheduled {when}",
]
EXTRACTION_INSTRUCTIONS = (
    "You are the command parser of a mobile banking assistant. Read the customer's saved payees, accounts "
    "and recent activity below, then turn the customer's spoken command into one JSON object with the fields "
    "intent (transfer, pay_bill, balance, schedule or cancel), amount, currency, payee, source_account and "
    "date. Use the context to resolve names and accounts. Answer with the JSON object only."
)
# A shallow schema: flat fields, short bounded strings, so constrained output stays short and always closes.
EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "intent": {"type": "string", "enum": ["transfer", "pay_bill", "balance", "schedule", "cancel"]},
        "amount": {"type": "string", "maxLength": 10},
        "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
        "payee": {"type": "string", "maxLength": 24},
        "date": {"type": "string", "maxLength": 10},
    },
    "required": ["intent", "amount", "currency", "payee", "date"],
    "additionalProperties": False,
}
QNA_TOPICS = [
    "compound interest",
    "a mortgage",
    "inflation",
    "an index fund",
    "a credit score",
    "a budget",
    "the stock market",
    "an emergency fund",
    "currency exchange",
    "a savings account",
    "a pension",
    "taxes on savings",
    "a credit card",
    "student loans",
    "insurance",
    "cryptocurrency",
    "a central bank",
    "bonds",
    "a recession",
    "diversification",
]
QNA_TEMPLATES = [
    "Explain how {topic} works, step by step, with a worked example.",
    "What are the advantages and disadvantages of {topic}? Give a detailed answer.",
    "Write a short guide for a new customer who wants to understand {topic}.",
    "Compare {topic} with {topic2} and say when each one is the better choice.",
    "A friend asks you about {topic}. Write a friendly, detailed explanation with examples.",
    "Describe the history of {topic} and how it affects ordinary families today.",
]
AUDIO_RATE_HZ = 16000


@dataclass
class BenchRequest:
    """One chat request of a workload; ``body()`` renders the OpenAI JSON body."""

    messages: list[dict[str, Any]]
    max_tokens: int
    response_format: dict[str, Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # e.g. frame sizes; not sent

    def body(
        self,
        model: str | None,
        *,
        ignore_eos: bool = True,
        temperature: float = 0.0,
        stream: bool = True,
        show_special_tokens: bool = True,
    ) -> dict[str, Any]:
        """With ``ignore_eos`` (vLLM's extension) the output runs to ``max_tokens``; ``show_special_tokens``
        then also sends ``skip_special_tokens: false`` so that special tokens generated past the natural end
        (EOS, end of turn, ...) stream as chunks instead of vanishing from the client's timing."""
        body: dict[str, Any] = {
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": temperature,
            "stream": stream,
        }
        if model:
            body["model"] = model
        if stream:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            body["ignore_eos"] = True
            if show_special_tokens:
                body["skip_special_tokens"] = False
        if self.response_format is not None:
            body["response_format"] = self.response_format
        return body


class Workload:
    """A family of requests: ``request(namespace, index)`` is a pure function of the seed and its arguments.

    Workloads whose prompt length is a target in tokens (``target_prompt_tokens``) fill their prompt with
    ``filler_words`` words; ``calibrate`` sets that from measured probe prompts.
    """

    name = ""
    target_prompt_tokens: int | None = None

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.filler_words = 0
        self.calibration: dict[str, Any] | None = None

    def request(self, namespace: str, index: int) -> BenchRequest:
        return self.build(random.Random(f"{self.name}:{self.seed}:{namespace}:{index}"), self.filler_words)

    def build(self, rng: random.Random, filler_words: int) -> BenchRequest:
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """The parameters that define this workload (stored in results.json)."""
        return {"name": self.name, "seed": self.seed}

    def calibration_probes(self, probe_words: int = 300, repeats: int = 3) -> list[BenchRequest]:
        """A prompt without filler, then ``repeats`` prompts with ``probe_words`` filler words (different
        words each: a word's token count varies, more so with small vocabularies)."""
        probes = [self.build(random.Random(f"{self.name}:{self.seed}:calibration"), 0)]
        for i in range(repeats):
            probes.append(self.build(random.Random(f"{self.name}:{self.seed}:calibration:{i}"), probe_words))
        return probes

    def set_calibration(self, counts: list[int], probe_words: int = 300) -> None:
        """Set ``filler_words`` from the measured token counts of ``calibration_probes``."""
        base, probed = counts[0], counts[1:]
        per_word = max((sum(probed) / len(probed) - base) / probe_words, 1e-3)
        self.filler_words = max(0, round((self.target_prompt_tokens - base) / per_word))
        self.calibration = {
            "base_prompt_tokens": base,
            "tokens_per_word": round(per_word, 4),
            "filler_words": self.filler_words,
            "measured": True,
        }
        if base > self.target_prompt_tokens:
            self.calibration["note"] = (
                f"the prompt without filler already has {base} tokens, more than the "
                f"target {self.target_prompt_tokens}"
            )

    def calibrate(self, count_prompt_tokens: Callable[[BenchRequest], int]) -> None:
        """Set ``filler_words`` so prompts have ~``target_prompt_tokens`` tokens.

        ``count_prompt_tokens(request)`` returns the prompt tokens the target counts for a request (the
        server's ``usage.prompt_tokens`` of a 1-token probe, or the engine's tokenizer offline)."""
        if self.target_prompt_tokens is None:
            return
        self.set_calibration([count_prompt_tokens(r) for r in self.calibration_probes()])

    def assume_calibration(self, tokens_per_word: float = 1.3, base_prompt_tokens: int = 30) -> None:
        """Without probing: Gemma's tokenizer spends ~1.3 tokens per English word of the pool."""
        if self.target_prompt_tokens is None:
            return
        self.filler_words = max(0, round((self.target_prompt_tokens - base_prompt_tokens) / tokens_per_word))
        self.calibration = {
            "base_prompt_tokens": base_prompt_tokens,
            "tokens_per_word": tokens_per_word,
            "filler_words": self.filler_words,
            "measured": False,
        }


# ---- text -----------------------------------------------------------------------------------------------
def filler_text(rng: random.Random, n_words: int) -> str:
    """``n_words`` words of the pool as sentences of 6-16 words."""
    words, out = 0, []
    while words < n_words:
        k = min(rng.randint(6, 16), n_words - words)
        sentence = rng.choices(WORD_POOL, k=k)
        out.append(" ".join([sentence[0].capitalize(), *sentence[1:]]) + ".")
        words += k
    return " ".join(out)


class TextWorkload(Workload):
    """~``prompt_tokens`` (500) of unique filler text to summarise; ``output_tokens`` (10) out."""

    name = "text"

    def __init__(self, seed: int = 0, prompt_tokens: int = 500, output_tokens: int = 10):
        super().__init__(seed)
        self.target_prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens

    def build(self, rng: random.Random, filler_words: int) -> BenchRequest:
        text = "Summarize the following notes in one sentence.\n\n" + filler_text(rng, filler_words)
        return BenchRequest([{"role": "user", "content": text}], self.output_tokens)

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "prompt_tokens": self.target_prompt_tokens,
            "output_tokens": self.output_tokens,
        }


# ---- media ------------------------------------------------------------------------------------------------
def synthetic_scene(rng: random.Random, width: int, height: int, shapes: int = 12):
    """A smooth seeded picture (gradient + shapes), so JPEG sizes resemble photos rather than noise."""
    from PIL import Image, ImageDraw

    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    c0 = np.array([rng.random() for _ in range(3)], dtype=np.float32)
    cx = np.array([rng.random() - 0.5 for _ in range(3)], dtype=np.float32)
    cy = np.array([rng.random() - 0.5 for _ in range(3)], dtype=np.float32)
    pixels = np.clip(c0 + cx * x + cy * y, 0.0, 1.0) * 255.0
    image = Image.fromarray(pixels.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(shapes):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(8, max(9, width // 3)), y0 + rng.randrange(8, max(9, height // 3))
        color = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    return image


def jpeg_data_url(image, quality: int = 85) -> str:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def encode_mp4(frames: Iterable[Any], fps: int) -> bytes:
    """Frames of one size (PIL images or uint8 [H, W, 3] RGB arrays, taken one at a time) as an H.264
    (yuv420p) MP4, made with PyAV's libx264."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        for i, frame in enumerate(frames):
            rgb = np.asarray(frame.convert("RGB")) if hasattr(frame, "convert") else frame
            if i == 0:
                stream.height, stream.width = rgb.shape[:2]
                stream.pix_fmt = "yuv420p"
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def mp4_data_url(frames: list, fps: int) -> str:
    """PIL frames as an H.264 MP4 data URL (``encode_mp4``)."""
    return "data:video/mp4;base64," + base64.b64encode(encode_mp4(frames, fps)).decode("ascii")


def parse_size(text: str) -> tuple[int, int]:
    """``"854x480"`` -> (854, 480); ``"896"`` -> (896, 896)."""
    parts = str(text).lower().split("x")
    try:
        w, h = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise ValueError(f"size: expected WIDTHxHEIGHT or SIZE, got {text!r}") from None
    if len(parts) > 2 or w <= 0 or h <= 0:
        raise ValueError(f"size: expected WIDTHxHEIGHT or SIZE, got {text!r}")
    return w, h


class ImageWorkload(Workload):
    """One unique JPEG of ``image_size`` (as an ``image_url`` data URL) + a short question."""

    name = "image"

    def __init__(self, seed: int = 0, image_size: str = "1024x768", output_tokens: int = 10):
        super().__init__(seed)
        self.size = parse_size(image_size)
        self.output_tokens = output_tokens

    def build(self, rng: random.Random, filler_words: int) -> BenchRequest:
        url = jpeg_data_url(synthetic_scene(rng, *self.size))
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is shown in this picture?"},
        ]
        return BenchRequest(
            [{"role": "user", "content": content}], self.output_tokens, info={"image_size": self.size}
        )

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "image_size": f"{self.size[0]}x{self.size[1]}",
            "output_tokens": self.output_tokens,
        }


VIDEO_FORMATS = ("jpeg", "mp4")
VIDEO_FPS = 30


class VideoWorkload(Workload):
    """``num_frames`` (6) frames of ``frame_size`` (854x480, 480p) + short text: as a ``video`` part of JPEG
    data URLs (``video_format="jpeg"``), or as one H.264 MP4 at 30 fps (``"mp4"``, PyAV's libx264, a
    ``video_url`` data URL), which the server decodes as a container (on the host, or on NVDEC with
    ``--video-decoder nvdec``).

    Shapes move between frames, so frames differ as a real clip's do."""

    name = "video"

    def __init__(
        self,
        seed: int = 0,
        num_frames: int = 6,
        frame_size: str = "854x480",
        output_tokens: int = 10,
        video_format: str = "jpeg",
    ):
        super().__init__(seed)
        if video_format not in VIDEO_FORMATS:
            raise ValueError(f"--video-format: expected jpeg or mp4, got {video_format!r}")
        self.num_frames = num_frames
        self.size = parse_size(frame_size)
        self.output_tokens = output_tokens
        self.video_format = video_format

    def frames(self, rng: random.Random) -> list:
        from PIL import ImageChops

        width, height = self.size
        scene = synthetic_scene(rng, width, height)
        sprite = synthetic_scene(rng, max(8, width // 6), max(8, height // 6), shapes=3)
        dx, dy = rng.randrange(-width // 10, width // 10 + 1), rng.randrange(-height // 10, height // 10 + 1)
        x, y = rng.randrange(width), rng.randrange(height)
        out = []
        for i in range(self.num_frames):
            frame = ImageChops.offset(scene, i * dx // 4, 0)  # a slow pan
            frame.paste(sprite, ((x + i * dx) % width, (y + i * dy) % height))
            out.append(frame)
        return out

    def build(self, rng: random.Random, filler_words: int) -> BenchRequest:
        frames = self.frames(rng)
        if self.video_format == "mp4":
            part: dict[str, Any] = {
                "type": "video_url",
                "video_url": {"url": mp4_data_url(frames, VIDEO_FPS)},
            }
        else:
            part = {"type": "video", "video": [jpeg_data_url(f) for f in frames]}
        content = [part, {"type": "text", "text": "Describe what happens in this video."}]
        return BenchRequest(
            [{"role": "user", "content": content}],
            self.output_tokens,
            info={"num_frames": len(frames), "frame_size": self.size, "video_format": self.video_format},
        )

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "num_frames": self.num_frames,
            "frame_size": f"{self.size[0]}x{self.size[1]}",
            "video_format": self.video_format,
            "output_tokens": self.output_tokens,
        }


def synthetic_wav(rng: random.Random, seconds: float, rate: int = AUDIO_RATE_HZ) -> bytes:
    """A 16-bit mono WAV: a few gliding tones with syllable-like envelopes over low noise."""
    n = int(seconds * rate)
    t = np.arange(n, dtype=np.float64) / rate
    signal = np.zeros(n)
    for _ in range(4):
        f0, f1 = rng.uniform(120, 900), rng.uniform(120, 900)
        phase = 2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * max(seconds, 1e-3)))
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(2, 6) * t + rng.uniform(0, 2 * np.pi))
        signal += rng.uniform(0.05, 0.2) * envelope * np.sin(phase)
    noise = np.random.default_rng(rng.randrange(1 << 30)).normal(0, 0.01, n)
    pcm = np.clip((signal + noise) * 32767, -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return buf.getvalue()


class AudioWorkload(Workload):
    """One WAV clip of ``min_seconds``-``max_seconds`` (3-10 s, uniform) as ``input_audio`` + short text."""

    name = "audio"

    def __init__(
        self, seed: int = 0, min_seconds: float = 3.0, max_seconds: float = 10.0, output_tokens: int = 10
    ):
        super().__init__(seed)
        if not 0 < min_seconds <= max_seconds:
            raise ValueError(f"audio seconds: need 0 < min <= max, got {min_seconds}, {max_seconds}")
        self.min_seconds, self.max_seconds = min_seconds, max_seconds
        self.output_tokens = output_tokens

    def build(self, rng: random.Random, filler_words: int) -> BenchRequest:
        seconds = round(rng.uniform(self.min_seconds, self.max_seconds), 2)
        data = base64.b64encode(synthetic_wav(rng, seconds)).decode("ascii")
        content = [
            {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
            {"type": "text", "text": "Transcribe this audio clip."},
        ]
        return BenchRequest(
            [{"role": "user", "content": content}], self.output_tokens, info={"audio_seconds": seconds}
        )

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "audio_seconds": [self.min_seconds, self.max_seconds],
            "output_tokens": self.output_tokens,
        }


# ---- banking extraction ------------------------------------------------------------------------------------
def banking_command(rng: random.Random) -> str:
    account, account2 = rng.sample(ACCOUNTS, 2)
    amount = rng.choice([rng.randrange(5, 100), rng.randrange(100, 2000), round(rng.uniform(1, 500), 2)])
    return rng.choice(COMMANDS).format(
        amount=amount,
        name=f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
        when=rng.choice(WHEN),
        biller=rng.choice(BILLERS),
        account=account,
        account2=account2,
    )


def banking_context(rng: random.Random, n_words: int) -> str:
    """About ``n_words`` words of one customer's payees, accounts and transactions, one item a line."""
    lines, words = [], 0
    while words < n_words:
        kind = rng.random()
        if kind < 0.3:
            line = (
                f"Payee: {rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}, account ending "
                f"{rng.randrange(1000, 10000)}"
            )
        elif kind < 0.4:
            line = (
                f"Account: {rng.choice(ACCOUNTS)}, balance "
                f"{rng.randrange(0, 20000)}.{rng.randrange(100):02d} dollars"
            )
        else:
            verb = rng.choice(["card payment", "transfer to", "deposit from", "direct debit", "refund from"])
            other = rng.choice(
                [
                    f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
                    f"{rng.choice(BILLERS)} company",
                    " ".join(rng.choices(WORD_POOL, k=2)),
                ]
            )
            line = (
                f"March {rng.randrange(1, 29)}: {verb} {other}, {rng.randrange(1, 900)}."
                f"{rng.randrange(100):02d} dollars"
            )
        taken = line.split()[: n_words - words]
        lines.append(" ".join(taken))
        words += len(taken)
    return "\n".join(lines)


class ExtractionWorkload(Workload):
    """Banking commands ("send 40 dollars to Maria Lopez tomorrow") parsed against a customer context.

    The instructions (a shared system prompt, as a real assistant's would be) plus a per-request context
    fill ``prompt_tokens``; ``schema`` constrains the answer with a shallow JSON schema (``response_format``
    json_schema); without it the answer is free text of ``output_tokens``.
    """

    name = "extraction"
    PROMPT_SIZES = (128, 512, 1024, 2048)
    OUTPUT_SIZES = (16, 32, 64, 128)

    def __init__(
        self, seed: int = 0, prompt_tokens: int = 512, output_tokens: int = 32, schema: bool = False
    ):
        super().__init__(seed)
        self.target_prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.schema = schema

    def build(self, rng: random.Random, filler_words: int) -> BenchRequest:
        command = banking_command(rng)
        context = banking_context(rng, filler_words)
        user = (f"Customer context:\n{context}\n\n" if context else "") + f"Command: {command}"
        messages = [{"role": "system", "content": EXTRACTION_INSTRUCTIONS}, {"role": "user", "content": user}]
        response_format = None
        if self.schema:
            response_format = {
                "type": "json_schema",
                "json_schema": {"name": "banking_command", "schema": EXTRACTION_SCHEMA, "strict": True},
            }
        return BenchRequest(messages, self.output_tokens, response_format, info={"command": command})

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "prompt_tokens": self.target_prompt_tokens,
            "output_tokens": self.output_tokens,
            "schema": self.schema,
        }


# ---- open questions ----------------------------------------------------------------------------------------
class QnAWorkload(Workload):
    """Open questions with long answers: ``output_tokens`` fixed, or uniform in [min_output, max_output]."""

    name = "qna"

    def __init__(
        self,
        seed: int = 0,
        output_tokens: int | None = None,
        min_output_tokens: int = 128,
        max_output_tokens: int = 512,
    ):
        super().__init__(seed)
        if not 0 < min_output_tokens <= max_output_tokens:
            raise ValueError("qna: need 0 < min_output_tokens <= max_output_tokens")
        self.output_tokens = output_tokens
        self.min_output_tokens, self.max_output_tokens = min_output_tokens, max_output_tokens

    def build(self, rng: random.Random, filler_words: int) -> BenchRequest:
        topic, topic2 = rng.sample(QNA_TOPICS, 2)
        question = rng.choice(QNA_TEMPLATES).format(topic=topic, topic2=topic2)
        max_tokens = self.output_tokens or rng.randint(self.min_output_tokens, self.max_output_tokens)
        return BenchRequest([{"role": "user", "content": question}], max_tokens)

    def params(self) -> dict[str, Any]:
        out = self.output_tokens or [self.min_output_tokens, self.max_output_tokens]
        return {**super().params(), "output_tokens": out}


WORKLOADS: dict[str, type[Workload]] = {
    "text": TextWorkload,
    "video": VideoWorkload,
    "image": ImageWorkload,
    "audio": AudioWorkload,
    "extraction": ExtractionWorkload,
    "qna": QnAWorkload,
}


def make_workload(
    name: str,
    *,
    seed: int = 0,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
    image_size: str = "1024x768",
    num_frames: int = 6,
    frame_size: str = "854x480",
    video_format: str = "jpeg",
    audio_seconds: tuple[float, float] = (3.0, 10.0),
    schema: bool = False,
) -> Workload:
    """The workload ``name`` with the options that apply to it (others are ignored; None keeps defaults)."""
    if name not in WORKLOADS:
        raise ValueError(f"--workload: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    out = {} if output_tokens is None else {"output_tokens": output_tokens}
    prompt = {} if prompt_tokens is None else {"prompt_tokens": prompt_tokens}
    if name == "text":
        return TextWorkload(seed, **prompt, **out)
    if name == "image":
        return ImageWorkload(seed, image_size=image_size, **out)
    if name == "video":
        return VideoWorkload(
            seed, num_frames=num_frames, frame_size=frame_size, video_format=video_format, **out
        )
    if name == "audio":
        return AudioWorkload(seed, min_seconds=audio_seconds[0], max_seconds=audio_seconds[1], **out)
    if name == "extraction":
        return ExtractionWorkload(seed, schema=schema, **prompt, **out)
    return QnAWorkload(seed, **out)


def request_bytes(
    request: BenchRequest,
    model: str | None,
    *,
    ignore_eos: bool,
    temperature: float,
    show_special_tokens: bool = True,
    extra_body: dict[str, Any] | None = None,
) -> bytes:
    """The request's streamed body as compact JSON bytes (encoded once, off the send path); ``extra_body``'s
    fields are added to (or replace) the body's top-level fields."""
    body = request.body(
        model, ignore_eos=ignore_eos, temperature=temperature, show_special_tokens=show_special_tokens
    )
    if extra_body:
        body.update(extra_body)
    return json.dumps(body, separators=(",", ":")).encode()
