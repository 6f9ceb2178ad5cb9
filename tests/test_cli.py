"""The command line: ``g4serve make-tiny`` writes checkpoints that g4serve and transformers both load (and
agree on), ``g4serve generate`` prints a completion, and bad input exits non-zero with a message naming the
problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from g4serve import LLM, SamplingParams
from g4serve.assets import SAMPLE_NAMES, sample_path
from g4serve.cli import main
from g4serve.config import FULL, SLIDING, Gemma4Config
from g4serve.engine.kv_cache import PagedKVCache
from g4serve.layers.attention import TorchAttention, contiguous_metadata
from g4serve.models.gemma4.loader import load_model
from g4serve.processing.audio import SAMPLING_RATE, load_audio
from g4serve.processing.tokenizer import Tokenizer
from g4serve.processing.video import load_video

TINY_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "processor_config.json",
    "preprocessor_config.json",
    "generation_config.json",
)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """``g4serve make-tiny DIR --variant v`` for every variant, run once."""
    root = tmp_path_factory.mktemp("cli-tiny")
    out = {}
    for variant in ("e", "moe", "31b"):
        assert main(["make-tiny", str(root / variant), "--variant", variant]) == 0
        out[variant] = root / variant
    return out


@torch.inference_mode()
def _last_logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.cfg.text
    blocks = -(-len(ids) // 16)
    cache = PagedKVCache(cfg, {SLIDING: blocks, FULL: blocks}, 16, torch.float32, "cpu")
    table = list(range(blocks))
    meta = contiguous_metadata([0], [len(ids)], {SLIDING: [table], FULL: [table]}, 16, "cpu", [[]])
    hidden = model(torch.tensor(ids), meta, TorchAttention(cfg, cache), keep_indices=[len(ids) - 1])
    return model.compute_logits(hidden)[0]


def _generate_json(capsys, *args: str) -> dict:
    rc = main(["generate", "--device", "cpu", "--dtype", "float32", "--json", *args])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


# ---- make-tiny ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["e", "moe", "31b"])
def test_make_tiny_writes_a_complete_checkpoint(made, capsys, variant):
    path = made[variant]
    for name in TINY_FILES:
        assert (path / name).is_file(), name
    assert json.loads((path / "g4serve_tiny.json").read_text())["variant"] == variant
    cfg = Gemma4Config.from_pretrained(path)
    t = cfg.text
    if variant == "e":  # E2B/E4B-like
        assert t.hidden_size_per_layer_input > 0 and t.num_kv_shared_layers > 0 and cfg.audio is not None
        assert not t.attention_k_eq_v and not t.enable_moe_block
    else:  # 26B-A4B / 31B-like
        assert t.hidden_size_per_layer_input == 0 and t.num_kv_shared_layers == 0 and cfg.audio is None
        assert t.attention_k_eq_v and t.use_bidirectional_attention == "vision"
        assert t.enable_moe_block == (variant == "moe")
    model = load_model(path, dtype="float32", device="cpu")  # strict: no missing or unexpected tensors
    assert (model.audio_tower is not None) == (variant == "e")
    tok = Tokenizer.from_pretrained(path)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert rendered == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    assert tok.token_to_id("<|image|>") == cfg.image_token_id
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == t.eos_token_ids


def test_make_tiny_is_seeded(tmp_path, made):
    assert main(["make-tiny", str(tmp_path / "again"), "--variant", "moe"]) == 0
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        made["moe"] / "model.safetensors"
    ).read_bytes()
    assert main(["make-tiny", str(tmp_path / "seed1"), "--variant", "moe", "--seed", "1"]) == 0
    assert (tmp_path / "seed1" / "model.safetensors").read_bytes() != (
        made["moe"] / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("variant", ["e", "moe", "31b"])
def test_transformers_loads_make_tiny_checkpoints_and_agrees(made, variant):
    from transformers import AutoTokenizer, Gemma4ForConditionalGeneration

    path = made[variant]
    hf, info = Gemma4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    hf_tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is the balance of my savings account?"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    ours = load_model(path, dtype="float32", device="cpu")
    assert Tokenizer.from_pretrained(path).encode_chat(messages) == list(ids)
    with torch.inference_mode():
        expected = hf.eval()(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(_last_logits(ours, list(ids)), expected, atol=1e-4, rtol=0)


def test_make_tiny_rejects_an_unknown_variant(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "x"), "--variant", "70b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("g4serve make-tiny: error: variant: ") and "'70b'" in err and "e, moe, 31b" in err
    assert not (tmp_path / "x").exists()


# ---- generate ----------------------------------------------------------------------------------------------


def test_generate_prints_the_completion(made, capsys):
    path = made["e"]
    rc = main(
        [
            "generate",
            "--model",
            str(path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompt",
            "What is my balance?",
            "--max-tokens",
            "4",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_bytes=8 << 20)
    expected = llm.chat(
        [{"role": "user", "content": [{"type": "text", "text": "What is my balance?"}]}],
        SamplingParams(temperature=0, max_tokens=4),
    )[0]
    completion = expected.outputs[0]
    assert captured.out == completion.text + "\n"
    assert (
        f"[{len(expected.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
        f"finish={completion.finish_reason}"
    ) in captured.err
    assert len(completion.token_ids) == 4 or completion.finish_reason == "stop"


def test_generate_json_raw_and_image(made, tmp_path, capsys):
    path = str(made["e"])
    chat = _generate_json(capsys, "--model", path, "--prompt", "Hello", "--max-tokens", "4")
    assert len(chat["token_ids"]) <= 4 and chat["finish_reason"] in ("length", "stop")
    assert chat["finish_reason"] == "stop" or len(chat["token_ids"]) == 4
    tok = Tokenizer.from_pretrained(path)
    assert chat["prompt_tokens"] == len(tok.encode_chat([{"role": "user", "content": "Hello"}]))
    # Same greedy tokens on a second run.
    assert (
        _generate_json(capsys, "--model", path, "--prompt", "Hello", "--max-tokens", "4")["token_ids"]
        == chat["token_ids"]
    )

    raw = _generate_json(capsys, "--model", path, "--prompt", "Hello", "--raw", "--max-tokens", "3")
    assert raw["prompt_tokens"] == len(tok.encode("Hello"))

    image = tmp_path / "cat.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(image)
    with_image = _generate_json(
        capsys, "--model", path, "--prompt", "Hello", "--image", str(image), "--max-tokens", "2"
    )
    assert with_image["prompt_tokens"] > chat["prompt_tokens"] + 3  # <|image> + soft tokens + <image|>


def test_generate_uses_the_embedded_model_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("G4SERVE_CACHE", str(tmp_path / "cache"))
    out = _generate_json(capsys, "--prompt", "Hi", "--max-tokens", "2")
    assert 1 <= len(out["token_ids"]) <= 2
    built = list((tmp_path / "cache").iterdir())
    assert len(built) == 1 and (built[0] / "g4serve_tiny.json").is_file()  # built once, no temp dirs left


def test_generate_with_the_sample_image_video_and_audio(made, capsys):
    """The README's ``--image/--video/--audio`` lines on the shipped samples: each medium adds its own
    tokens to the prompt, and together they add exactly the sum."""
    path = str(made["e"])
    base = ["--model", path, "--prompt", "What is this?", "--max-tokens", "2"]
    text_only = _generate_json(capsys, *base)["prompt_tokens"]
    flags = {"--image": "sample.png", "--video": "sample.mp4", "--audio": "sample.wav"}
    added = {}
    for flag, name in flags.items():
        out = _generate_json(capsys, *base, flag, str(sample_path(name)))
        added[flag] = out["prompt_tokens"] - text_only
        assert 1 <= len(out["token_ids"]) <= 2
    assert added["--image"] > 3 and added["--audio"] > 3  # begin/end markers plus soft tokens
    assert added["--video"] > 16 * 2  # 16 frames, each with its soft tokens and a timestamp
    every = [a for flag, name in flags.items() for a in (flag, str(sample_path(name)))]
    assert _generate_json(capsys, *base, *every)["prompt_tokens"] == text_only + sum(added.values())


def test_sample_assets_exist_are_small_and_decode():
    for name in SAMPLE_NAMES:
        assert 0 < sample_path(name).stat().st_size < 200_000, name  # they ship in every wheel
    with Image.open(sample_path("sample.png")) as image:
        assert image.format == "PNG" and image.size == (320, 240)
        image.convert("RGB").load()
    video = load_video(sample_path("sample.mp4"))
    assert len(video.frames) >= 8 and video.frames.shape[1:] == (120, 160, 3) and video.fps == 8.0
    assert video.frames[0].std() > 0 and not np.array_equal(video.frames[0], video.frames[-1])  # it moves
    info = soundfile.info(str(sample_path("sample.wav")))
    assert (info.samplerate, info.channels, info.subtype) == (SAMPLING_RATE, 1, "PCM_16")
    audio = load_audio(sample_path("sample.wav"))
    assert audio.dtype == np.float32 and audio.ndim == 1 and 2.0 <= len(audio) / SAMPLING_RATE <= 3.5
    assert 0.1 < np.abs(audio).max() <= 1.0  # speech, not silence
    with pytest.raises(FileNotFoundError, match="sample.png, sample.mp4, sample.wav"):
        sample_path("cat.png")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "{tmp}/no-such-model"], "neither a checkpoint directory nor a preset"),
        (["--model", "{tmp}"], "tokenizer.json"),  # a directory that is not a checkpoint
        (["--model", "{e}", "--dtype", "float8"], "dtype: unknown dtype 'float8'"),
        (["--model", "{e}", "--max-tokens", "0"], "max_tokens"),
        (["--model", "{e}", "--temperature", "-1"], "temperature"),
        (["--model", "{e}", "--image", "{tmp}/missing.png"], "image[0]"),
        (
            ["--model", "{e}", "--device", "cuda:0"]
            if not torch.cuda.is_available()
            else ["--model", "{e}", "--device", "nonsense"],
            "device",
        ),
    ],
)
def test_generate_errors_exit_2_with_a_message(made, tmp_path, capsys, args, message):
    argv = ["generate", "--prompt", "Hi", "--max-tokens", "2"]
    argv += [a.format(tmp=tmp_path, e=made["e"]) for a in args]
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("g4serve generate: error: ") and message in err
    assert "Traceback" not in err


def test_bad_model_path_in_a_subprocess(tmp_path):
    """The installed entry point's exit status and stderr, end to end."""
    missing = tmp_path / "nowhere"
    env = {**os.environ, "G4SERVE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "g4serve.cli",
            "generate",
            "--model",
            str(missing),
            "--prompt",
            "Hi",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert (
        f"g4serve generate: error: model: {missing} is neither a checkpoint directory nor a preset"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "cache").exists()  # nothing was built for a request that failed
