"""Where do g4serve's logits and transformers' part ways on this CPU? A diagnostic for oracle drift.

For every case of tests/models/test_gemma4_parity.py it prints and saves the largest logit difference against
transformers' eager model, twice: with each modality's items encoded in one call, as transformers batches them
(``encode_items``, what the test uses), and with one encoder call per item. The soft tokens of both encodings
are compared with transformers' own. Then it compares the engine's batched encoder with per-item encoding on
the tiny model (tests/engine's mixed prompts).

    python bench/parity_drift.py --out drift.json

Run it under different CPUs, ``ATEN_CPU_CAPABILITY`` / ``MKL_ENABLE_INSTRUCTIONS`` values and oracle
versions: a difference that moves with the GEMM shapes is float noise, one that moves with the oracle
version alone is a change in transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT / "src"),
    str(ROOT / "tests"),
    str(ROOT / "tests" / "models"),
    str(ROOT / "tests" / "engine"),
]

import conftest  # noqa: E402  (tests/: the tiny checkpoints the oracle tests build)
import test_engine  # noqa: E402
import test_gemma4_parity as parity  # noqa: E402
import transformers  # noqa: E402

from g4serve import LLM  # noqa: E402
from g4serve.processing.image import rescale_pixels  # noqa: E402
from g4serve.reference import encode_items  # noqa: E402


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def encode_one_by_one(model, items) -> torch.Tensor:
    """Soft tokens in prompt order, one encoder call per item (the reference path before this diagnosis)."""
    outs = []
    for item in sorted(items, key=lambda it: it.offset):
        if item.modality == "audio":
            outs.extend(model.encode_audio(item.data["input_features"], item.data["input_features_mask"]))
        else:
            pixels = rescale_pixels(item.data["pixel_values"], video=item.modality == "video")
            outs.extend(model.encode_images(pixels, item.data["position_ids"]))
    return torch.cat(outs)


def our_logits(llm, processed, mm_embeds) -> torch.Tensor:
    """tests/models/test_gemma4_parity.py's forward, with the soft tokens given."""
    real = parity.encode_items
    parity.encode_items = lambda model, items: mm_embeds
    try:
        return parity._our_logits(llm, processed)
    finally:
        parity.encode_items = real


def hf_soft_tokens(hf, kwargs: dict) -> torch.Tensor | None:
    """transformers' own soft tokens for the prompt, in prompt order (images, videos, audio: one kind a
    case)."""
    inner = hf.model
    if "pixel_values" in kwargs:
        out = inner.get_image_features(kwargs["pixel_values"], kwargs["image_position_ids"], return_dict=True)
        return torch.cat(list(out.pooler_output))
    if "pixel_values_videos" in kwargs:
        out = inner.get_video_features(
            kwargs["pixel_values_videos"],
            kwargs["video_position_ids"],
            kwargs["num_frames_per_video"],
            return_dict=True,
        )
        pooled = out.pooler_output
        return torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
    if "input_features" in kwargs:
        out = inner.get_audio_features(
            kwargs["input_features"], kwargs["input_features_mask"], return_dict=True
        )
        mask = out.attention_mask if getattr(out, "attention_mask", None) is not None else None
        tokens = out.pooler_output
        return tokens[mask] if mask is not None else tokens.flatten(0, 1)
    return None


def parity_cases(workdir: Path) -> list[dict]:
    rows = []
    for variant in ("e", "moe", "31b"):
        path = conftest.build_hf_checkpoint(workdir / f"hf-{variant}", variant)
        hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        llm = LLM(str(path), device="cpu", dtype="float32")
        for case_variant, prompt in parity.CASES:
            if case_variant != variant:
                continue
            text, media = parity.PROMPTS[prompt]
            processed = llm.processor(
                prompt=text, images=media.get("image"), videos=media.get("video"), audio=media.get("audio")
            )
            kwargs = parity._hf_inputs(llm, processed)
            row = {"case": f"{variant}-{prompt}"}
            with torch.inference_mode():
                ref = hf(**kwargs).logits[0]
                row["logits"] = _max_diff(parity._our_logits(llm, processed), ref)  # what the test asserts
                if processed.mm_items:
                    hf_tokens = hf_soft_tokens(hf, kwargs)
                    batched = encode_items(llm.model, processed.mm_items)  # transformers' batching
                    alone = encode_one_by_one(llm.model, processed.mm_items)
                    row["logits_one_by_one"] = _max_diff(our_logits(llm, processed, alone), ref)
                    row["soft_tokens_batched"] = _max_diff(batched, hf_tokens)
                    row["soft_tokens_one_by_one"] = _max_diff(alone, hf_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def engine_encoder_case(workdir: Path) -> dict:
    from g4serve.tiny import make_tiny

    engine = test_engine.make_engine(make_tiny(workdir / "tiny-e", "e"))
    items = [
        it
        for p in test_engine.mixed_prompts()
        if isinstance(p, dict)
        for it in engine.process_prompt(p).mm_items
    ]
    model = engine.model
    alone = {}
    with torch.inference_mode():
        for item in items:
            if item.modality == "audio":
                (alone[item.content_hash],) = model.encode_audio(
                    item.data["input_features"], item.data["input_features_mask"]
                )
            else:
                pixels = rescale_pixels(item.data["pixel_values"], video=item.modality == "video")
                alone[item.content_hash] = torch.cat(model.encode_images(pixels, item.data["position_ids"]))
    engine.encoder.run(items)
    diffs = {d: _max_diff(engine.encoder_cache.get(d), t) for d, t in alone.items()}
    row = {
        "case": "engine batched encoder vs per item",
        "max_diff": max(diffs.values()),
        "items_bit_equal": sum(v == 0.0 for v in diffs.values()),
        "items": len(diffs),
        "max_abs_value": max(t.abs().max().item() for t in alone.values()),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))  # as tests/conftest.py
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "processor": platform.processor(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
        "MKL_ENABLE_INSTRUCTIONS": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
    }
    try:
        env["cpu_model"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    print(json.dumps(env), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = {"env": env, "parity": parity_cases(Path(tmp)), "encoder": engine_encoder_case(Path(tmp))}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
