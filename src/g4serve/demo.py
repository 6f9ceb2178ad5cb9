"""``python -m g4serve.demo``: the whole pipeline on the embedded tiny model, with text, image, video and audio.

The tiny model has random weights, so the words are noise; what the demo shows is every
path (tokenizer, chat template, processors, encoders, decoder, sampler) running end to end.
"""

from __future__ import annotations

import time

import numpy as np
from PIL import Image

from g4serve import LLM, SamplingParams


def synthetic_media() -> dict[str, object]:
    y, x = np.mgrid[0:240, 0:320]
    image = Image.fromarray(np.stack([x % 256, y % 256, (x + y) % 256], axis=-1).astype(np.uint8))
    frames = [np.roll(np.asarray(image), shift=8 * i, axis=1) for i in range(6)]
    t = np.arange(16000 * 2) / 16000
    audio = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return {"image": image, "video": frames, "audio": audio}


def main() -> None:
    t0 = time.perf_counter()
    llm = LLM()
    print(f"loaded the embedded tiny model in {time.perf_counter() - t0:.2f}s on {llm.device}")
    media = synthetic_media()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    cases = {
        "text": [{"type": "text", "text": "What is my checking account balance?"}],
        "image": [{"type": "image", "image": media["image"]}, {"type": "text", "text": "Describe this image."}],
        "video": [{"type": "video", "video": media["video"]}, {"type": "text", "text": "What happens here?"}],
        "audio": [{"type": "audio", "audio": media["audio"]}, {"type": "text", "text": "Transcribe this."}],
    }
    for name, content in cases.items():
        t0 = time.perf_counter()
        out = llm.chat([{"role": "user", "content": content}], params)[0]
        c = out.outputs[0]
        print(f"[{name:5s}] {len(out.prompt_token_ids):4d} prompt tokens -> {len(c.token_ids)} tokens "
              f"in {time.perf_counter() - t0:.2f}s: {c.text!r}")


if __name__ == "__main__":
    main()
