"""``python -m g4serve.demo``: the whole pipeline on the embedded tiny model: text, image, video and audio.

The tiny model has random weights, so the words are noise; what the demo shows is every
path (tokenizer, chat template, processors, encoders, decoder, sampler) running end to end.
The media are the sample files shipped in ``g4serve/assets/samples/`` (a picture, a 2 s clip
and a spoken sentence), passed by path as a user would pass their own files.
"""

from __future__ import annotations

import time

from g4serve import LLM, SamplingParams
from g4serve.assets import sample_path


def sample_media() -> dict[str, str]:
    """The shipped sample files by modality, as the path strings ``LLM.chat`` content items take."""
    return {
        "image": str(sample_path("sample.png")),
        "video": str(sample_path("sample.mp4")),
        "audio": str(sample_path("sample.wav")),
    }


def main() -> None:
    t0 = time.perf_counter()
    llm = LLM()
    print(f"loaded the embedded tiny model in {time.perf_counter() - t0:.2f}s on {llm.device}")
    media = sample_media()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    questions = {"image": "Describe this image.", "video": "What happens here?", "audio": "Transcribe this."}
    cases = {"text": [{"type": "text", "text": "What is my checking account balance?"}]}
    for kind, question in questions.items():
        cases[kind] = [{"type": kind, kind: media[kind]}, {"type": "text", "text": question}]
    for name, content in cases.items():
        t0 = time.perf_counter()
        out = llm.chat([{"role": "user", "content": content}], params)[0]
        c = out.outputs[0]
        print(
            f"[{name:5s}] {len(out.prompt_token_ids):4d} prompt tokens -> {len(c.token_ids)} tokens "
            f"in {time.perf_counter() - t0:.2f}s: {c.text!r}"
        )


if __name__ == "__main__":
    main()
