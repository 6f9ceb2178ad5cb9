"""EngineConfig is the one source of the engine's defaults: the CLI flags are made from its fields and the
scheduler reads it, so a default written once cannot drift between `g4serve serve`, LLM() and the engine."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from g4serve.engine.config import EngineConfig
from g4serve.engine_args import add_engine_arguments, engine_config_from_args, parse_mm_limits
from g4serve.server.launch import add_serve_arguments
from g4serve.server.launch import engine_config_from_args as serve_engine_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


def test_no_flags_give_the_dataclass_defaults():
    assert engine_config_from_args(_parser().parse_args([])) == EngineConfig()


def test_every_option_has_a_flag_with_help():
    parser = _parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    for f in dataclasses.fields(EngineConfig):
        if f.metadata.get("cli", True):
            assert f.name in flags, f"EngineConfig.{f.name} has no flag"
            assert flags[f.name].help, f"--{f.name.replace('_', '-')} has no help"
    assert set(flags) <= {f.name for f in dataclasses.fields(EngineConfig)}


def test_flags_set_the_fields():
    args = _parser().parse_args(
        "--max-num-seqs 8 --max-num-batched-tokens 512 --no-async-scheduling --no-enable-prefix-caching "
        "--kv-cache-bytes 1048576 --attention-backend torch --enforce-eager "
        "--limit-mm-per-prompt image=2".split()
    )
    config = engine_config_from_args(args, model="tiny")
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.kv_cache_bytes) == (8, 512, 1 << 20)
    assert not config.async_scheduling and not config.enable_prefix_caching and config.enforce_eager
    assert config.attention_backend == "torch" and config.model == "tiny"
    assert config.limit_mm_per_prompt == {
        "image": 2,
        "video": 4,
        "audio": 8,
    }  # the others keep their defaults


def test_bad_flag_values_are_rejected():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--attention-backend", "cudnn"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--limit-mm-per-prompt", "pictures=2"])


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"image": Infinity}', "image must be an integer"),  # int(inf) would overflow
        ('{"image": 2.7}', "image must be an integer"),  # not truncated to 2
        ('{"image": true}', "image must be an integer"),
        ('{"image": [1]}', "image must be an integer"),
        ("image=abc", "image must be an integer"),
        ("image=-1", "image must be >= 0"),
        ("image", "cannot parse"),
        ('{"image": 2', "cannot parse"),
        ('{"image": {"image": {"image": 1}}}', "image must be an integer"),
    ],
)
def test_hostile_mm_limits_get_a_clear_error(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_mm_limits(text)
    assert parse_mm_limits('{"image": 2}') == {"image": 2} and parse_mm_limits(" audio=0 ") == {"audio": 0}


def test_serve_takes_its_engine_flags_from_the_config():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["tiny", "--max-num-seqs", "4", "--text-only"])
    config = serve_engine_config(args)
    assert config == EngineConfig(model="tiny", max_num_seqs=4, text_only=True)
    assert config.text_only_mode


def test_the_token_budget_defaults_by_device():
    """Resolved from the device option: 8,192 on CUDA (measured, docs/benchmarks.md), 2,048 on CPU ("auto":
    whichever torch sees); an explicit value stays, and a bad one is refused naming the field."""
    import torch

    from g4serve.engine.config import default_token_budget

    assert (default_token_budget("cuda"), default_token_budget("cpu")) == (8192, 2048)
    assert EngineConfig(device="cpu").max_num_batched_tokens == 2048
    assert EngineConfig(device="cuda:1").max_num_batched_tokens == 8192
    assert EngineConfig().max_num_batched_tokens == (8192 if torch.cuda.is_available() else 2048)
    assert EngineConfig(device="cuda", max_num_batched_tokens=512).max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


def test_the_kv_cache_leaves_room_for_media_prepared_on_the_gpu():
    """With media prepared on the GPU (the CUDA default), the KV budget keeps DeviceMedia's bound free: the
    in-flight pixels and each preparing thread's float frame, ~800 MB at the defaults."""
    from g4serve.config import preset
    from g4serve.engine.config import PREPROCESS_WORKERS
    from g4serve.engine.engine import kv_reserve
    from g4serve.processing.device_media import device_memory_bound

    text = preset("e4b").text
    host = kv_reserve(EngineConfig(device="cuda", media_on_gpu=False), text, torch.bfloat16)
    gpu = kv_reserve(EngineConfig(device="cuda"), text, torch.bfloat16)
    assert gpu - host == device_memory_bound(PREPROCESS_WORKERS) == 3 * (1 << 27) + 4 * 12 * (1 << 23)
    assert kv_reserve(EngineConfig(device="cuda", text_only=True), text, torch.bfloat16) == host
    # NVDEC's decoders: each preparing thread's surfaces for 2048 x 1088 frames, ~300 MB at four threads
    nvdec = kv_reserve(EngineConfig(device="cuda", video_decoder="nvdec"), text, torch.bfloat16)
    assert nvdec - gpu == PREPROCESS_WORKERS * 24 * 2048 * 1088 * 3 // 2


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 2.0**20])
def test_a_hostile_media_cache_size_is_refused_by_name(value):
    """``--mm-processor-cache-gb``: negative, NaN, infinite or absurd sizes fail the config with the field's
    name (NaN would compare false everywhere and int(inf) would overflow into the cache's byte bound)."""
    with pytest.raises(ValueError, match="mm_processor_cache_gb"):
        EngineConfig(mm_processor_cache_gb=value)
    assert EngineConfig(mm_processor_cache_gb=0).mm_processor_cache_gb == 0  # off is fine
