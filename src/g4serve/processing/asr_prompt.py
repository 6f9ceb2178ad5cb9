"""Gemma 4's speech instructions: the ASR (transcribe) and AST (transcribe, then translate into English)
prompts of Google's Gemma 4 audio usage, as one user turn holding the audio and then the instruction, the
translation read back out of an AST answer (``<transcription>\\nEnglish: <translation>``), and the answers
of a long recording's clips joined into one transcript, whole or as they stream."""

from __future__ import annotations

from typing import Any

# ISO-639-1 codes (OpenAI's `language` field) -> the English names the instructions use.
LANGUAGE_NAMES = {
    "af": "Afrikaans", "am": "Amharic", "ar": "Arabic", "az": "Azerbaijani", "be": "Belarusian",
    "bg": "Bulgarian", "bn": "Bengali", "bs": "Bosnian", "ca": "Catalan", "cs": "Czech", "cy": "Welsh",
    "da": "Danish", "de": "German", "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian",
    "eu": "Basque", "fa": "Persian", "fi": "Finnish", "fil": "Filipino", "fr": "French", "ga": "Irish",
    "gl": "Galician", "gu": "Gujarati", "ha": "Hausa", "he": "Hebrew", "hi": "Hindi", "hr": "Croatian",
    "hu": "Hungarian", "hy": "Armenian", "id": "Indonesian", "is": "Icelandic", "it": "Italian",
    "ja": "Japanese", "ka": "Georgian", "kk": "Kazakh", "km": "Khmer", "kn": "Kannada", "ko": "Korean",
    "lo": "Lao", "lt": "Lithuanian", "lv": "Latvian", "mi": "Maori", "mk": "Macedonian", "ml": "Malayalam",
    "mr": "Marathi", "ms": "Malay", "my": "Burmese", "ne": "Nepali", "nl": "Dutch", "no": "Norwegian",
    "pa": "Punjabi", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sk": "Slovak",
    "sl": "Slovenian", "so": "Somali", "sq": "Albanian", "sr": "Serbian", "sv": "Swedish", "sw": "Swahili",
    "ta": "Tamil", "te": "Telugu", "th": "Thai", "tl": "Tagalog", "tr": "Turkish", "uk": "Ukrainian",
    "ur": "Urdu", "uz": "Uzbek", "vi": "Vietnamese", "yo": "Yoruba", "zh": "Chinese", "zu": "Zulu",
}  # fmt: skip

_FORMAT_RULES = (
    "Follow these specific instructions for formatting the answer:\n"
    "* Only output the transcription, with no newlines.\n"
    "* When transcribing numbers, write the digits, i.e. write 1.7 and not one point seven, and write 3 "
    "instead of three."
)
TRANSLATION_MARKER = "English:"


def language_name(code: str) -> str:
    """``"en"``, ``"EN"``, ``"en-US"`` -> ``"English"``; a ValueError naming ``language`` otherwise."""
    primary = code.strip().replace("_", "-").split("-")[0].lower()
    name = LANGUAGE_NAMES.get(primary)
    if name is None:
        raise ValueError(
            f"language: {code[:20]!r} is not a supported ISO-639-1 code (e.g. 'en', 'de', 'fr', 'ja')"
        )
    return name


def speech_instruction(task: str, language: str | None, context: str | None = None) -> str:
    """The instruction for ``task`` ("transcribe" or "translate" into English) of speech in ``language``
    (a name, or None: the model hears which). ``context``: the request's ``prompt`` (text before this
    segment, or words and spellings to use), appended as a hint."""
    if task == "transcribe" or language == "English":
        heard = "in its original language" if language is None else f"in {language} into {language} text"
        text = f"Transcribe the following speech segment {heard}.\n\n{_FORMAT_RULES}"
    elif task == "translate":
        source = language or "its original language"
        heard = language or "the original language"
        text = (
            f"Transcribe the following speech segment in {source}, then translate it into English.\n"
            f"When formatting the answer, first output the transcription in {heard}, then one newline, "
            f"then output the string '{TRANSLATION_MARKER} ', then the translation in English."
        )
    else:
        raise ValueError(f"task: expected 'transcribe' or 'translate', got {task!r}")
    if context:
        text += (
            f"\n\nContext (the text before this segment, or words and spellings it may contain): {context}"
        )
    return text


def speech_messages(task: str, language: str | None, context: str | None = None) -> list[dict[str, Any]]:
    """One user turn: the audio first, then the instruction (Gemma 4's audio usage)."""
    instruction = speech_instruction(task, language, context)
    return [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": instruction}]}]


def extract_translation(reply: str) -> str:
    """The English translation of an AST answer: the text after ``English:``. A reply without the marker
    (the model did not follow the format) is returned whole."""
    at = reply.find(TRANSLATION_MARKER)
    return reply if at < 0 else reply[at + len(TRANSLATION_MARKER) :].lstrip()


class TranslationStream:
    """``extract_translation`` over a streamed reply: nothing is sent until the marker arrives, then the
    text after it as it comes; a reply that ends without the marker is sent whole at the end. Each piece is
    searched only with the end of the text before it (a reply that never says the marker stays linear: the
    whole reply searched and copied at every piece took 20 s for 120,000 pieces)."""

    def __init__(self) -> None:
        self._pieces: list[str] = []  # the reply up to the piece that completed the marker
        self._tail = ""  # the last characters before the current piece, where the marker may have begun
        self.open = False
        self._started = False  # leading whitespace after the marker is dropped

    @property
    def reply(self) -> str:
        return "".join(self._pieces)

    def feed(self, text: str) -> str:
        if self.open:
            return self._after_marker(text)
        self._pieces.append(text)
        window = self._tail + text
        at = window.find(TRANSLATION_MARKER)
        if at < 0:
            self._tail = window[len(window) - len(TRANSLATION_MARKER) + 1 :]
            return ""
        self.open = True
        return self._after_marker(window[at + len(TRANSLATION_MARKER) :])

    def _after_marker(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text

    def finish(self) -> str:
        """What is left to send once the reply is complete."""
        return "" if self.open else self.reply


def join_transcripts(answers: list[str]) -> str:
    """The transcript of a recording heard in clips: each clip's answer (its translation, for a
    translation) stripped, the non-empty ones joined by one space."""
    return " ".join(stripped for stripped in (answer.strip() for answer in answers) if stripped)


class TranscriptStream:
    """``join_transcripts`` (after ``extract_translation`` when ``extract``) over the clips' replies
    streamed one clip after the other: ``feed`` a clip's text as it comes and ``end_clip`` once its reply
    is complete; each returns what may be sent now. Whitespace at the end of what a clip has said so far is
    held back until more of its text follows."""

    def __init__(self, extract: bool) -> None:
        self.extract = extract
        self.sent: list[str] = []
        self._translation = TranslationStream() if extract else None
        self._started = False  # the current clip has said something that is not whitespace
        self._held: list[str] = []  # whitespace not sent yet (a list: a long run of it stays linear)

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return "".join(self.sent)

    def feed(self, text: str) -> str:
        return self._tell(self._translation.feed(text) if self._translation else text)

    def end_clip(self) -> str:
        told = self._tell(self._translation.finish()) if self._translation else ""
        self._translation = TranslationStream() if self.extract else None
        self._started, self._held = False, []
        return told

    def _tell(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
            self._held = [" "] if self.sent else []  # the space between two clips' answers
        body = text.rstrip()
        if not body:
            self._held.append(text)
            return ""
        told = "".join(self._held) + body
        self._held = [text[len(body) :]]
        self.sent.append(told)
        return told


__all__ = [
    "LANGUAGE_NAMES",
    "TRANSLATION_MARKER",
    "TranscriptStream",
    "TranslationStream",
    "extract_translation",
    "join_transcripts",
    "language_name",
    "speech_instruction",
    "speech_messages",
]
