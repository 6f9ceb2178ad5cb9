"""Hostile and unsupported adapter directories are refused by name before any weight is used; the registry
keeps slots, names and running requests consistent through loads and unloads."""

from __future__ import annotations

import shutil

import pytest
import torch
from adapter_files import CONFIG, LM, Q0, WEIGHTS, edit_config, edit_weights

from g4serve import LLM, LoRARequest, SamplingParams
from g4serve.config import Gemma4Config
from g4serve.lora import LoRAAdapterError, load_peft_adapter

VISION_Q0 = "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj"


def _load(path, cfg, max_rank=8):
    return load_peft_adapter(path, cfg, max_rank, torch.float32)


def test_the_adapter_loads(adapter):
    path, cfg = adapter
    loaded = _load(path, cfg)
    assert loaded.rank == 4
    # 12 layers x 7 projections, less K and V of the 4 KV-shared layers (PEFT's weights for them are no-ops)
    assert len(loaded.weights) == 76


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(use_dora=True), "use_dora is not supported"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="IA3"), "only LORA adapters"),
        (dict(bias="all"), "bias"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out"),
        (dict(target_parameters=["experts.gate_up_proj"]), "target_parameters"),
        (dict(lora_alpha="a lot"), "lora_alpha"),
        (dict(lora_alpha=float("inf")), "finite"),
        (dict(alpha_pattern={"(": 2.0}), "not a regex"),
    ],
)
def test_unsupported_configs(adapter, change, message):
    path, cfg = adapter
    edit_config(path, **change)
    with pytest.raises(LoRAAdapterError, match=message.replace("(", r"\(")):
        _load(path, cfg)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop(f"{Q0}.lora_B.weight"), "lora_B missing"),
        (lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(4, 7)}), r"do not fit the projection"),
        (lambda t: t.update({f"{Q0}.lora_A.weight": torch.full((4, 64), float("nan"))}), "NaN"),
        (
            lambda t: t.update({f"{VISION_Q0}.lora_A.weight": torch.zeros(1)}),
            "adapts the vision tower",
        ),
        (
            lambda t: t.update({f"{LM}.0.per_layer_input_gate.lora_A.weight": torch.zeros(1)}),
            "not a LoRA weight of a decoder projection",
        ),
        (
            lambda t: t.update({f"{LM}.0.mlp.router.lora_A.weight": torch.zeros(1)}),
            "LoRA on router is not supported",
        ),
        (
            lambda t: t.update({f"{LM}.99.mlp.up_proj.lora_A.weight": torch.zeros(1)}),
            "layer 99",
        ),
        (lambda t: t.update({"base_model.model.lm_head.lora_embedding_A": torch.zeros(1)}), "lm_head"),
    ],
)
def test_hostile_weights(adapter, edit, message):
    path, cfg = adapter
    edit_weights(path, edit)
    with pytest.raises(LoRAAdapterError, match=message):
        _load(path, cfg)


def test_rank_above_the_slots_is_refused(adapter):
    path, cfg = adapter
    with pytest.raises(LoRAAdapterError, match="rank 4 exceeds --max-lora-rank 2"):
        _load(path, cfg, max_rank=2)


def test_v_proj_on_a_k_eq_v_layer_is_refused(lora_adapter, tmp_path):
    base, src, _ = lora_adapter("moe")
    path = tmp_path / "moe"
    shutil.copytree(src, path)
    key = f"{LM}.2.self_attn.v_proj.lora_A.weight"
    edit_weights(path, lambda t: t.update({key: torch.zeros(4, 64)}))
    with pytest.raises(LoRAAdapterError, match="attention_k_eq_v"):
        _load(path, Gemma4Config.from_pretrained(base).text)


def test_files_that_are_not_an_adapter(adapter, tmp_path):
    path, cfg = adapter
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        _load(tmp_path / "nowhere", cfg)
    (path / CONFIG).write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="not valid JSON"):
        _load(path, cfg)
    (path / CONFIG).write_text(" " * (2 << 20))
    with pytest.raises(LoRAAdapterError, match="larger than"):
        _load(path, cfg)
    (path / CONFIG).write_text("{}")
    (path / WEIGHTS).rename(path / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match="pickle"):
        _load(path, cfg)
    (path / WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(LoRAAdapterError, match="cannot be read"):
        _load(path, cfg)
    # bigger than any rank-8 adapter of this model could be: refused before it is read
    with open(path / WEIGHTS, "wb") as f:
        f.truncate(64 << 20)
    with pytest.raises(LoRAAdapterError, match="is more than any adapter"):
        _load(path, cfg)


def test_slots_names_and_unload_while_running(lora_adapter):
    base = lora_adapter("all")[0]
    paths = {n: str(lora_adapter(n)[1]) for n in ("all", "qv", "mlp")}
    llm = LLM(
        base,
        device="cpu",
        text_only=True,
        kv_cache_bytes=16 << 20,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    engine = llm.engine
    engine.load_lora("a", paths["all"])
    engine.load_lora("b", paths["qv"])
    with pytest.raises(ValueError, match="all 2 adapter slots are in use"):
        engine.load_lora("c", paths["mlp"])
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora("a", paths["mlp"])
    with pytest.raises(ValueError, match="not a usable name"):
        engine.load_lora("bad name\n", paths["mlp"])

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [40, 41, 42]}], params, lora_request=LoRARequest("a"))[0]
    request = engine.make_request(
        "r", engine.process_prompt({"prompt_token_ids": [40, 41, 42]}), params, lora_name="a"
    )
    engine.add_request(request)
    engine.step()
    engine.unload_lora("a")  # the running request keeps its adapter; new ones cannot name it
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        engine.make_request("s", engine.process_prompt({"prompt_token_ids": [40]}), params, lora_name="a")
    with pytest.raises(ValueError, match="all 2 adapter slots"):  # its slot is still held
        engine.load_lora("c", paths["mlp"])
    finished = engine.run_until_finished()
    assert finished["r"].outputs[0].token_ids == alone.outputs[0].token_ids
    engine.load_lora("c", paths["mlp"])  # the slot is free once the request finished
    assert sorted(engine.lora.names()) == ["b", "c"]
    assert all(p.num_free == p.num_blocks for p in engine.kv.pools.values())
    # reloading a name gives it a new identity: no prefix-cache hits from the adapter it replaced
    engine.unload_lora("c")
    engine.load_lora("c", paths["all"])
    again = llm.generate([{"prompt_token_ids": [40, 41, 42]}], params, lora_request=LoRARequest("c"))[0]
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids


def test_an_adapter_unloaded_between_check_and_queue_fails_alone(lora_adapter):
    base, adapter, _ = lora_adapter("all")
    llm = LLM(base, device="cpu", text_only=True, kv_cache_bytes=16 << 20, lora_modules={"a": str(adapter)})
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2)
    request = engine.make_request(
        "r", engine.process_prompt({"prompt_token_ids": [40, 41]}), params, lora_name="a"
    )
    engine.unload_lora("a")
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        engine.add_request(request)
    assert not engine.requests and engine.lora.names() == []


def test_lora_modules_flag_parses_both_forms():
    import argparse

    from g4serve.engine_args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(
        ["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--lora-modules", "c=/z"]
    )
    config = engine_config_from_args(args)
    assert config.lora_modules == {"a": "/x", "b": "/y", "c": "/z"} and config.enable_lora
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])
