"""Shared fixtures: tiny random Gemma 4 checkpoints written by transformers' own classes.

Each checkpoint directory holds what ``save_pretrained`` writes plus the tiny tokenizer and
processor configs, so g4serve loads it like a real Hugging Face model directory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

SLIDING, FULL = "sliding_attention", "full_attention"
# Special-token ids of g4serve's tiny tokenizer (g4serve.processing.tiny_tokenizer.SPECIAL_TOKENS).
TOKEN_IDS = dict(
    boi_token_id=10,
    eoi_token_id=11,
    image_token_id=12,
    boa_token_id=13,
    eoa_token_index=14,
    audio_token_id=15,
    video_token_id=16,
)

_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    position_embedding_size=1024,
)
_AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    subsampling_conv_channels=[128, 4],
    output_proj_dims=48,
)
_TEXT = dict(
    vocab_size=1024,
    vocab_size_per_layer_input=1024,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    final_logit_softcapping=30.0,
    max_position_embeddings=4096,
    eos_token_id=[1, 6],
)

# The architectures the oracle tests cover, shrunk.
VARIANTS: dict[str, dict] = {
    # E2B/E4B: per-layer embeddings, KV sharing, 5:1 sliding/full, proportional RoPE, audio.
    "e": dict(
        text=dict(
            _TEXT,
            num_hidden_layers=12,
            layer_types=([SLIDING] * 5 + [FULL]) * 2,
            sliding_window=12,
            num_kv_shared_layers=4,
            hidden_size_per_layer_input=16,
        ),
        audio=True,
    ),
    # 26B-A4B: routed experts beside the dense MLP, K=V global layers, bidirectional image attention.
    "moe": dict(
        text=dict(
            _TEXT,
            num_hidden_layers=6,
            layer_types=[SLIDING, SLIDING, FULL] * 2,
            sliding_window=12,
            hidden_size_per_layer_input=0,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            use_bidirectional_attention="vision",
        ),
        audio=False,
    ),
    # 31B: dense, K=V global layers with fewer KV heads, bidirectional image attention.
    "31b": dict(
        text=dict(
            _TEXT,
            num_hidden_layers=6,
            layer_types=[SLIDING, SLIDING, FULL] * 2,
            sliding_window=12,
            hidden_size_per_layer_input=0,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            use_bidirectional_attention="vision",
        ),
        audio=False,
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from init: N(0, 0.05) matrices, norms near 1, random position tables, finite clips.

    The matrix scale keeps the tiny decoder from amplifying rounding noise chaotically: transformers'
    own eager and SDPA paths then differ by ~1e-4 in the logits, not ~4e-4 as with N(0, 0.1).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif name.endswith("per_dim_scale"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.tensor([0.8]))
            elif name.endswith(("input_max", "output_max")):
                b.fill_(4.0)
            elif name.endswith(("input_min", "output_min")):
                b.fill_(-4.0)


def build_hf_checkpoint(out: Path, variant: str, seed: int = 0) -> Path:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from g4serve.config import Gemma4Config as OurConfig
    from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
    from g4serve.tiny import _processor_configs

    spec = VARIANTS[variant]
    cfg = Gemma4Config(
        text_config=spec["text"],
        vision_config=_VISION,
        audio_config=_AUDIO if spec["audio"] else None,
        **TOKEN_IDS,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(out)
    write_tiny_tokenizer(out, vocab_size=spec["text"]["vocab_size"])
    ours = OurConfig.from_pretrained(out)
    for name, content in _processor_configs(ours).items():
        (out / name).write_text(json.dumps(content, indent=2))
    return out


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(variant) -> Path`` built once per session and variant."""
    cache: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = build_hf_checkpoint(tmp_path_factory.mktemp(f"hf-{variant}"), variant)
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """g4serve's own embedded tiny checkpoint (make-tiny, variant e)."""
    from g4serve.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-e"), "e")


def _wav_claiming(rate: int, num_bytes: int = 64_000, channels: int = 1) -> bytes:
    """A PCM16 RIFF/WAVE file whose header claims any sample rate (the wave module refuses odd ones)."""
    block = channels * 2
    fmt = struct.pack("<HHIIHH", 1, channels, rate, (rate * block) & 0xFFFFFFFF, block, 16)
    data = bytes(num_bytes)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(riff)) + riff


@pytest.fixture(scope="session")
def wav_claiming():
    """``wav_claiming(rate, num_bytes=64_000, channels=1)``: hostile WAV bytes for the media tests."""
    return _wav_claiming


# ---- LoRA adapters -------------------------------------------------------------------------------------
# PEFT adapters made by ``peft`` itself on the tiny checkpoints, and their merged checkpoints: the oracle of
# the LoRA tests is ``merge_and_unload()``, i.e. W + scale * B @ A computed by PEFT.
LANGUAGE = r".*language_model.*\."
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name -> (variant, LoraConfig keyword arguments)
ADAPTERS: dict[str, tuple[str, dict]] = {
    # every attention and MLP projection, rank 4
    "all": ("e", dict(r=4, lora_alpha=8, target_modules=LANGUAGE + f"({'|'.join(ALL)})")),
    # a higher rank on q/v only, rsLoRA scaling and a per-module alpha
    "qv": (
        "e",
        dict(
            r=8,
            lora_alpha=16,
            use_rslora=True,
            alpha_pattern={"v_proj": 4.0},
            target_modules=LANGUAGE + "(q_proj|v_proj)",
        ),
    ),
    # MLP only, rank 2
    "mlp": ("e", dict(r=2, lora_alpha=2, target_modules=LANGUAGE + "(gate_proj|up_proj|down_proj)")),
    # 26B-A4B layout: the full layers take V from K (attention_k_eq_v), so the adapter has no v_proj there
    "moe": ("moe", dict(r=4, lora_alpha=4, target_modules=LANGUAGE + f"({'|'.join(ALL)})")),
}


def _peft_model(base: Path, kwargs: dict, seed: int):
    import peft
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: an adapter that changes nothing tests nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return peft_model


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, dst / f.name)


@pytest.fixture(scope="session")
def lora_adapter(hf_checkpoint, tmp_path_factory):
    """``lora_adapter(name) -> (base dir, adapter dir, merged checkpoint dir)``, built once per session."""
    cache: dict[str, tuple[Path, Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path, Path]:
        if name not in cache:
            variant, kwargs = ADAPTERS[name]
            base = hf_checkpoint(variant)
            root = tmp_path_factory.mktemp(f"lora-{name}")
            model = _peft_model(base, kwargs, seed=len(cache) + 1)
            model.save_pretrained(root / "adapter")
            merged = model.merge_and_unload()
            merged.save_pretrained(root / "merged")
            _copy_side_files(base, root / "merged")
            cache[name] = (base, root / "adapter", root / "merged")
        return cache[name]

    return get


# ---- MTP drafter ------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def mtp_drafter(hf_checkpoint, tmp_path_factory):
    """(target dir, drafter dir): transformers' tiny E-type target and a tiny Gemma4Assistant drafter for it
    (random weights, written by ``save_pretrained``)."""
    return hf_checkpoint("e"), _write_drafter(tmp_path_factory.mktemp("assistant"), ordered=False)


@pytest.fixture(scope="session")
def mtp_drafter_ordered(hf_checkpoint, tmp_path_factory):
    """``mtp_drafter`` with ``use_ordered_embeddings``: logits only for the tokens of the top centroid
    clusters (32 clusters of 32 tokens, top 4), under a random token ordering."""
    return hf_checkpoint("e"), _write_drafter(tmp_path_factory.mktemp("assistant-ordered"), ordered=True)


def _write_drafter(out, ordered: bool):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    text = Gemma4TextConfig(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=12,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        num_kv_shared_layers=3,
    )
    extra = (
        dict(use_ordered_embeddings=True, num_centroids=32, centroid_intermediate_top_k=4) if ordered else {}
    )
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, **extra)
    torch.manual_seed(3)
    drafter = Gemma4AssistantForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.05 if p.ndim >= 2 else 1.0 + 0.2 * torch.randn(p.shape))
        if ordered:
            drafter.masked_embedding.token_ordering.copy_(torch.randperm(1024))
    drafter.save_pretrained(out)
    return out
