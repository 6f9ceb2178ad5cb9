"""Tiny random Gemma 4 checkpoints in Hugging Face format, built locally in about a second.

The ``e`` variant (E2B/E4B-like: PLE, KV sharing, vision and audio towers) is the embedded
default model of every g4serve command, so a new user sees the whole system work with no
download. ``moe`` (26B-A4B-like) and ``31b`` (31B-like) cover the other architectures.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from g4serve import envs
from g4serve.config import FULL, SLIDING, Gemma4Config, TextConfig, VisionConfig, preset
from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer

TINY_FORMAT_VERSION = 2  # 2: q/k norm scales head_dim**-0.25
VARIANTS = ("e", "moe", "31b")
_ALIASES = {"dense": "e", "e2b": "e", "e4b": "e", "26b-a4b": "moe", "26b": "moe"}


def tiny_config(variant: str = "e") -> Gemma4Config:
    variant = _ALIASES.get(variant, variant)
    cfg = preset("tiny")
    if variant == "e":
        return cfg
    t = cfg.text
    large = dict(
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        use_bidirectional_attention="vision",
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    )
    if variant == "moe":
        large.update(
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            intermediate_size=96,
        )
    elif variant != "31b":
        raise ValueError(f"variant: unknown tiny variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    fields = {**t.__dict__, **large}
    cfg.text = TextConfig(**fields)
    cfg.text.validate()
    cfg.audio = None
    cfg.vision = VisionConfig(**{**cfg.vision.__dict__, "num_attention_heads": 2, "num_key_value_heads": 2})
    return cfg


def _random_state_dict(cfg: Gemma4Config, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights under Hugging Face names, large enough that greedy choices are not near-ties."""
    from g4serve.models.gemma4.loader import build_model, init_random_weights

    model = build_model(cfg, torch.float32, "cpu")
    init_random_weights(model, seed=seed, std=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    state = {}
    for name, tensor in model.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if tensor.ndim == 1 and leaf == "weight":
            # Non-trivial norm scales exercise the norm code paths.
            tensor = tensor + 0.25 * torch.randn(tensor.shape, generator=gen)
        if leaf == "position_embedding_table":
            tensor = torch.randn(tensor.shape, generator=gen) * 0.1
        state["model." + name] = tensor.contiguous()
    return state


def _processor_configs(cfg: Gemma4Config) -> dict[str, dict]:
    vision = cfg.vision or VisionConfig()
    image = {
        "image_processor_type": "Gemma4ImageProcessor",
        "max_soft_tokens": 280,
        "patch_size": vision.patch_size,
        "pooling_kernel_size": vision.pooling_kernel_size,
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": False,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "image_mean": [0.0] * 3,
        "image_std": [1.0] * 3,
    }
    video = {
        **image,
        "video_processor_type": "Gemma4VideoProcessor",
        "max_soft_tokens": 70,
        "num_frames": 32,
        "do_sample_frames": True,
        "do_normalize": True,
    }
    video.pop("image_processor_type")
    audio = {
        "feature_extractor_type": "Gemma4AudioFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "frame_length": 320,
        "hop_length": 160,
        "fft_length": 512,
        "min_frequency": 0.0,
        "max_frequency": 8000.0,
        "mel_floor": 0.001,
        "padding_value": 0.0,
        "return_attention_mask": True,
    }
    processor = {
        "processor_class": "Gemma4Processor",
        "image_seq_length": 280,
        "audio_seq_length": 750,
        "audio_ms_per_token": 40,
        "image_processor": image,
        "video_processor": video,
    }
    if cfg.audio is not None:
        processor["feature_extractor"] = audio
    return {
        "processor_config.json": processor,
        "preprocessor_config.json": image,
        "video_preprocessor_config.json": video,
    }


def make_tiny(out_dir: str | Path, variant: str = "e", seed: int = 0) -> Path:
    """Write a complete tiny checkpoint (config, weights, tokenizer, chat template, processor configs)."""
    cfg = tiny_config(variant)  # before mkdir: a bad variant leaves no empty directory behind
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out)
    save_file(_random_state_dict(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tiny_tokenizer(out, vocab_size=cfg.text.vocab_size)
    for name, content in _processor_configs(cfg).items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    generation = {
        "bos_token_id": cfg.text.bos_token_id,
        "eos_token_id": cfg.text.eos_token_ids,
        "pad_token_id": cfg.text.pad_token_id,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "g4serve_tiny.json").write_text(
        json.dumps({"variant": variant, "seed": seed, "version": TINY_FORMAT_VERSION}) + "\n"
    )
    return out


def cache_dir() -> Path:
    """g4serve's cache directory: ``$G4SERVE_CACHE``, else ``~/.cache/g4serve`` (not created here)."""
    return Path(envs.get("G4SERVE_CACHE") or Path.home() / ".cache" / "g4serve")


def default_model_dir() -> Path:
    """The embedded default model, built on first use in the user's cache directory."""
    path = cache_dir() / f"tiny-e-v{TINY_FORMAT_VERSION}"
    marker = path / "g4serve_tiny.json"
    if not marker.is_file():
        # Build beside the target and rename, so a concurrent or interrupted build never
        # leaves a half-written model behind.
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        make_tiny(tmp, "e", seed=0)
        if path.exists() and not marker.is_file():
            shutil.rmtree(path)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


__all__ = ["VARIANTS", "cache_dir", "default_model_dir", "make_tiny", "tiny_config"]
