"""Word accuracy of the assistant's speech recognisers on espeak-ng speech: pocketsphinx with the domain LM
(the default), pocketsphinx's general English model, and Gemma hearing the audio (``--asr gemma``).

    python bench/assistant_asr.py --out bench/results                          # CPU, embedded tiny model
    python bench/assistant_asr.py --model /models/gemma-4-E4B-it --device cuda --out bench/results

Each utterance (payee names and amounts, the demo customer's payees) is synthesized as
bench/assistant_latency.py does, trimmed by the VAD, and fed to each recogniser in 0.25 s chunks as the
assistant does. Word accuracy is 1 - WER over all words, on the normalized text (both sides through the
assistant's normalizer, so "$50" and "fifty dollars" are the same words "50.00 usd"); it falls below 0 when
a recogniser inserts more words than were said. Writes assistant_asr_<device>_<model>.json and a markdown
table beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from assistant_latency import SPOKEN_UTTERANCES, percentiles, synthesize  # noqa: E402

from g4serve.bench.meta import command_line

# Requests that name a payee of the demo customer and most of them an amount, as a customer says them.
NAMED_UTTERANCES = [
    "send forty dollars to aisha khan",
    "transfer seventy five dollars to ahmed hassan",
    "pay city electric ninety four dollars",
    "send one hundred dollars to mary johnson",
    "pay maria gonzalez one thousand five hundred dollars",
    "send twenty euros to francois dubois",
    "wire two hundred dollars to tom wilson",
    "pay skyline mobile sixty five dollars",
    "give yuki tanaka thirty dollars",
    "pay northside internet fifty nine dollars",
    "send ten dollars to my mom",
    "pay evergreen gas eighty dollars",
    "transfer five hundred dollars to robert brown",
    "send ten dollars and fifty cents to sean o'brien",
    "pay harbor insurance one hundred twenty dollars",
    "send twenty five dollars to katherine lee",
    "transfer three hundred dollars to olga ivanova",
    "pay stephen clarke forty five dollars",
    "send sixty dollars to li wei",
    "pay metro water utility thirty dollars",
    "send fifty bucks to joan smith",
    "transfer twelve dollars to jose garcia",
    "pay catherine li eighteen dollars",
    "send two thousand dollars to hans muller",
]
UTTERANCES = list(dict.fromkeys(NAMED_UTTERANCES + SPOKEN_UTTERANCES))
RECOGNIZERS = ("pocketsphinx", "pocketsphinx-general", "gemma")
_CHUNK_S = 0.25  # as Assistant.hear feeds a recording


def word_errors(reference: list[str], hypothesis: list[str]) -> int:
    """Levenshtein distance over words: substitutions + deletions + insertions."""
    previous = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        current = [i]
        for j, hyp in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref != hyp)))
        previous = current
    return previous[-1]


def normalized_words(text: str) -> list[str]:
    from g4serve_assistant.normalize import normalize

    return normalize(text).text.split() if text.strip() else []


def spoken(text: str) -> list[str]:
    from g4serve_assistant.vocabulary import spoken_words

    return spoken_words(text)


def recognize(recognizer, speech: np.ndarray) -> tuple[str, float, dict]:
    """The final transcript, the recogniser's wall time (ms) from the first chunk to the transcript, and
    the transcript's details (gemma: tokens, raw output)."""
    step = int(_CHUNK_S * 16000)
    start = time.perf_counter()
    stream = recognizer.stream()
    for i in range(0, speech.size, step):
        stream.feed(speech[i : i + step])
    transcript = stream.finish()
    ms = (time.perf_counter() - start) * 1000
    return transcript.text, ms, {"error": transcript.error, **transcript.details}


def score(pairs: list[tuple[str, str]]) -> dict:
    """Corpus-level figures over (reference, hypothesis) pairs."""
    ref_n = sum(len(normalized_words(r)) for r, _ in pairs)
    errors = sum(word_errors(normalized_words(r), normalized_words(h)) for r, h in pairs)
    raw_n = sum(len(spoken(r)) for r, _ in pairs)
    raw_errors = sum(word_errors(spoken(r), spoken(h)) for r, h in pairs)
    exact = sum(normalized_words(r) == normalized_words(h) for r, h in pairs)
    return {
        "word_accuracy": round(1 - errors / ref_n, 4),
        "wer": round(errors / ref_n, 4),
        "reference_words": ref_n,
        "word_errors": errors,
        "word_accuracy_spoken_words": round(1 - raw_errors / raw_n, 4),
        "exact_sentence_rate": round(exact / len(pairs), 4),
        "exact_sentences": exact,
    }


def build_engine(args: argparse.Namespace):
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.engine.engine import EngineConfig
    from g4serve_assistant.asr_gemma import audio_engine_options

    model = None if args.model == "tiny" else args.model
    kv = args.kv_cache_bytes or ((64 << 20) if args.device == "cpu" else None)
    return AsyncLLMEngine.from_config(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_bytes=kv,
            max_model_len=4096,
            gpu_memory_utilization=0.5,
            **audio_engine_options(model),
        )
    )


def synthesize_clips(voices: list[str], words_per_minute: int) -> list[tuple[str, str, np.ndarray]]:
    """(text, voice, VAD-trimmed speech) per utterance and voice."""
    from g4serve_assistant.vad import VoiceActivityDetector

    vad = VoiceActivityDetector()
    clips = []
    with tempfile.TemporaryDirectory() as tmp:
        for voice in voices:
            for i, text in enumerate(UTTERANCES):
                audio = synthesize(text, Path(tmp) / f"{voice}-{i}.wav", voice, words_per_minute)
                speech = vad.trim(audio)
                clips.append((text, voice, speech if speech is not None and speech.size else audio))
    return clips


def run(recognizer, clips: list[tuple[str, str, np.ndarray]], repeats: int, gemma: bool) -> dict:
    """One recogniser over every clip (``repeats`` times for latency; the first pass is scored)."""
    recognize(recognizer, clips[0][2])  # warm-up: models loaded, the prompt's prefix cached
    pairs, latencies, details, transcripts = [], [], [], {}
    for r in range(repeats):
        for text, voice, speech in clips:
            heard, ms, info = recognize(recognizer, speech)
            latencies.append(ms)
            details.append(info)
            if r == 0:
                pairs.append((text, heard))
                transcripts[f"{voice}: {text}"] = heard
    result = {"n": len(pairs), **score(pairs), "latency_ms": percentiles(latencies)}
    if gemma:
        result.update(
            prompt_tokens=percentiles([d.get("prompt_tokens", 0) for d in details]),
            cached_tokens=percentiles([d.get("cached_tokens", 0) for d in details]),
            output_tokens=percentiles([d.get("output_tokens", 0) for d in details]),
            finish_reasons={
                f: sum(str(d.get("finish_reason")) == f for d in details)
                for f in sorted({str(d.get("finish_reason")) for d in details})
            },
            errors=sum(d.get("error") is not None for d in details),
            max_tokens=recognizer.max_tokens,
            raw_outputs={k: d.get("raw") for k, d in zip(transcripts, details, strict=False)},
        )
    result["transcripts"] = transcripts
    return result


def markdown(report: dict) -> str:
    lines = [
        f"# Assistant ASR word accuracy ({report['device']}, model {report['model']})",
        "",
        f"commit {report['commit']}, {report['date']}, {report['utterances']} espeak-ng utterances "
        f"({', '.join(report['voices'])}, {report['words_per_minute']} wpm) x {report['repeats']}",
        "",
        f"`{report['command']}`",
        "",
        "| recogniser | word accuracy (1 - WER) | exact sentences | latency p50 ms | latency p95 ms |",
        "|---|---|---|---|---|",
    ]
    for name, r in report["recognizers"].items():
        lat = r["latency_ms"]
        lines.append(
            f"| {name} | {r['word_accuracy']:.3f} | {r['exact_sentences']}/{r['n']} "
            f"({r['exact_sentence_rate']:.0%}) | {lat['p50']:.1f} | {lat['p95']:.1f} |"
        )
    gemma = report["recognizers"].get("gemma")
    if gemma:
        lines += [
            "",
            f"gemma: prompt tokens p50 {gemma['prompt_tokens']['p50']:.0f}, cached p50 "
            f"{gemma['cached_tokens']['p50']:.0f}, output tokens p50 {gemma['output_tokens']['p50']:.0f}, "
            f"finish reasons {gemma['finish_reasons']}, errors {gemma['errors']}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="tiny", help="checkpoint directory or preset for the gemma recogniser"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument(
        "--recognizers", default=",".join(RECOGNIZERS), help=f"comma-separated, of {', '.join(RECOGNIZERS)}"
    )
    parser.add_argument("--voices", default="en-us", help="espeak-ng voices, comma-separated")
    parser.add_argument("--words-per-minute", type=int, default=165)
    parser.add_argument("--repeats", type=int, default=1, help="passes over the clips (latency samples)")
    parser.add_argument("--gemma-timeout-s", type=float, default=60.0)
    parser.add_argument("--out", default="bench/results", help="directory for the JSON and markdown reports")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.recognizers.split(",") if n.strip()]
    unknown = set(names) - set(RECOGNIZERS)
    if unknown:
        parser.error(f"--recognizers: unknown {sorted(unknown)}; choose from {', '.join(RECOGNIZERS)}")

    import torch

    from g4serve.bench.meta import device_name, git_commit
    from g4serve_assistant.asr import make_recognizer
    from g4serve_assistant.asr_gemma import GemmaRecognizer
    from g4serve_assistant.db import demo_db
    from g4serve_assistant.vocabulary import DomainVocabulary

    if args.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    payees = demo_db().payees()
    vocab = DomainVocabulary.build(
        [p.display_name for p in payees], version=1, aliases=[a for p in payees for a in p.aliases]
    )
    voices = [v.strip() for v in args.voices.split(",") if v.strip()]
    clips = synthesize_clips(voices, args.words_per_minute)
    engine = build_engine(args) if "gemma" in names else None
    results: dict[str, dict] = {}
    try:
        for name in names:
            if name == "gemma":
                recognizer = GemmaRecognizer(engine, vocab, timeout_s=args.gemma_timeout_s)
            else:
                recognizer = make_recognizer(name, vocab)
            results[name] = result = run(recognizer, clips, args.repeats, gemma=name == "gemma")
            accuracy, exact = result["word_accuracy"], result["exact_sentence_rate"]
            print(f"{name}: word accuracy {accuracy:.3f}, exact sentences {exact:.0%}")
    finally:
        if engine is not None:
            engine.shutdown()

    report = {
        "benchmark": "assistant_asr",
        "commit": git_commit(),
        "device": device_name(args.device),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(),
        "model": args.model if "gemma" in names else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "utterances": len(UTTERANCES),
        "voices": voices,
        "words_per_minute": args.words_per_minute,
        "repeats": args.repeats,
        "scoring": "word_accuracy = 1 - WER over all words of the normalized texts (assistant normalizer); "
        "word_accuracy_spoken_words: the same over lower-case spoken words, no normalization",
        "units": {"latency_ms": "milliseconds, first chunk fed -> final transcript", "*_tokens": "tokens"},
        "recognizers": results,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in (args.device + "_" + Path(args.model).name)).lower()
    path = out_dir / f"assistant_asr_{slug}.json"
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    path.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
