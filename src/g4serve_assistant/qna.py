"""QnA over the knowledge base: a small BM25 retriever and a streamed Gemma answer grounded in the top
documents.

Without an engine the answer is the best document's text (extractive), so the endpoint works with
``--no-llm``.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from g4serve_assistant.knowledge import DOCUMENTS, Document

QNA_SYSTEM = (
    "You are the voice assistant of a bank. Answer the customer's question in one or two short spoken "
    "sentences, using only the documents below. If they do not answer it, say you do not know and offer to "
    "connect the customer to an agent. Never invent numbers."
)
_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    "a an and are at be by can do does for from how i in is it me much my of on or the to what when where "
    "which who why will with you your".split()
)
# Words customers say for what the documents call something else.
_SYNONYMS = {
    "open": ("hours",),
    "close": ("hours",),
    "closing": ("hours",),
    "opening": ("hours",),
    "cost": ("fee", "fees"),
    "charge": ("fee", "fees"),
    "price": ("fee", "fees"),
    "interest": ("rate", "apy"),
    "rate": ("apy",),
    "cash": ("withdraw", "atm"),
    "stolen": ("lost",),
    "lost": ("stolen",),
    "replace": ("replacement",),
    "new": ("replacement",),
    "wire": ("wires",),
    "deadline": ("cutoff", "before"),
    "cutoff": ("before",),
    "check": ("cheque",),
    "checks": ("cheque",),
    "abroad": ("foreign", "international"),
    "take": ("withdraw",),
    "withdraw": ("withdrawal",),
    "withdrawal": ("withdraw",),
    "maximum": ("limit",),
    "most": ("limit",),
}


def _terms(text: str) -> list[str]:
    words = []
    for word in _WORD.findall(text.lower()):
        if word in _STOP:
            continue
        # Crude plural folding: "fees" and "fee" should meet; short words ("is", "us") are left alone.
        words.append(word[:-1] if len(word) > 4 and word.endswith("s") and not word.endswith("ss") else word)
    return words


@dataclass(frozen=True)
class Hit:
    document: Document
    score: float


class KnowledgeIndex:
    """Okapi BM25 over title + text (k1=1.2, b=0.75); small enough to rebuild on every start."""

    def __init__(self, documents: Sequence[Document] = DOCUMENTS, k1: float = 1.2, b: float = 0.75):
        self.documents = list(documents)
        self.k1, self.b = k1, b
        # The title counts twice: it names the topic in the words a question uses.
        self._tf = [Counter(_terms(f"{d.title} {d.title} {d.text}")) for d in self.documents]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg_len = sum(self._len) / max(len(self._len), 1)
        df: Counter[str] = Counter()
        for tf in self._tf:
            df.update(tf.keys())
        n = len(self.documents)
        self._idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def search(self, question: str, k: int = 3, min_score: float = 0.5) -> list[Hit]:
        terms = _terms(question)
        terms += [s for t in list(terms) for s in _SYNONYMS.get(t, ())]
        hits = []
        for doc, tf, length in zip(self.documents, self._tf, self._len, strict=True):
            score = 0.0
            for term in terms:
                f = tf.get(term, 0)
                if f:
                    norm = self.k1 * (1 - self.b + self.b * length / self._avg_len)
                    score += self._idf[term] * f * (self.k1 + 1) / (f + norm)
            if score >= min_score:
                hits.append(Hit(doc, score))
        hits.sort(key=lambda h: -h.score)
        return hits[:k]


def build_qna_messages(question: str, hits: Sequence[Hit]) -> list[dict]:
    """Chat messages: the fixed instruction first, then the retrieved documents and the question."""
    context = "\n".join(f"[{h.document.doc_id}] {h.document.title}: {h.document.text}" for h in hits)
    return [
        {"role": "system", "content": QNA_SYSTEM},
        {"role": "user", "content": f"Documents:\n{context or '(none)'}\n\nQuestion: {question}"},
    ]


def qna_prompt(tokenizer, question: str, hits: Sequence[Hit]) -> str:
    """The model's prompt for ``question``: the customer's words as text, never spelling a control token."""
    messages = build_qna_messages(tokenizer.as_text(question), hits)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def extractive_answer(hits: Sequence[Hit]) -> str:
    """The answer without a model: the best document's text, or a hand-off when nothing matched."""
    if not hits:
        return "I don't have information on that. Would you like me to connect you to an agent?"
    return hits[0].document.text


async def answer_events(
    question: str, index: KnowledgeIndex, engine=None, max_tokens: int = 96, k: int = 3
) -> AsyncIterator[dict]:
    """Events of one streamed answer: ``documents``, then ``delta`` s of text, then ``done`` with stage
    timings (ms).

    ``engine`` is an ``AsyncLLMEngine`` or None (extractive answer).
    """
    from g4serve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    hits = index.search(question, k=k)
    stages = {"retrieval": round((time.perf_counter() - t0) * 1000, 3)}
    yield {
        "type": "documents",
        "documents": [
            {"doc_id": h.document.doc_id, "title": h.document.title, "score": round(h.score, 3)} for h in hits
        ],
    }
    if engine is None or not hits:
        # No grounding documents: a canned hand-off is safer than letting the model guess.
        yield {"type": "delta", "text": extractive_answer(hits)}
        stages["total"] = round((time.perf_counter() - t0) * 1000, 3)
        yield {"type": "done", "path": "extractive", "stages": stages}
        return
    prompt = qna_prompt(engine.tokenizer, question, hits)
    processed = await engine.process(prompt, add_special_tokens=False)
    t_llm = time.perf_counter()
    first = None
    finish_reason = None
    async for delta in engine.generate(processed, SamplingParams(temperature=0.0, max_tokens=max_tokens)):
        if delta.text:
            if first is None:
                first = time.perf_counter()
            yield {"type": "delta", "text": delta.text}
        if delta.finished:
            finish_reason = delta.finish_reason
    end = time.perf_counter()
    stages["llm_first_token"] = round(((first or end) - t_llm) * 1000, 3)
    stages["llm"] = round((end - t_llm) * 1000, 3)
    stages["total"] = round((end - t0) * 1000, 3)
    yield {"type": "done", "path": "gemma", "finish_reason": finish_reason, "stages": stages}
