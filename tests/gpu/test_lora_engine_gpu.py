"""LoRA adapters on CUDA: the Triton kernels inside captured CUDA graphs give the CPU reference path's
greedy tokens (fp32), with adapters and the base model mixed in one batch, loads after capture included."""

from __future__ import annotations

import pytest
import torch

from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.lora.synthetic import write_random_adapter
from g4serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(30, 30 + n)) for n in (5, 40, 17, 70)]


def _run(engine: LLMEngine, adapters: list[str | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, (ids, name) in enumerate(zip(PROMPTS, adapters)):
        prompt = engine.process_prompt({"prompt_token_ids": ids})
        engine.add_request(engine.make_request(str(i), prompt, params, lora_name=name))
    done = engine.run_until_finished()
    return [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]


def test_graphs_with_adapters_match_the_cpu_reference(hf_checkpoint, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    base = hf_checkpoint("e")
    engines = {
        device: LLMEngine(
            EngineConfig(
                model=str(base),
                device=device,
                dtype="float32",
                kv_cache_bytes=64 << 20,
                max_num_batched_tokens=64,
                enable_lora=True,
                max_loras=3,
                max_lora_rank=16,
                text_only=True,
            )
        )
        for device in ("cpu", "cuda")
    }
    cfg = engines["cpu"].model_config.text
    paths = {
        "a": write_random_adapter(tmp_path / "a", cfg, rank=8, seed=1, std=0.2, dtype=torch.float32),
        "b": write_random_adapter(
            tmp_path / "b",
            cfg,
            rank=16,
            seed=2,
            std=0.2,
            modules=("q_proj", "v_proj", "down_proj"),
            dtype=torch.float32,
        ),
    }
    for engine in engines.values():  # loaded after the CUDA engine captured its graphs
        for name, path in paths.items():
            engine.load_lora(name, str(path))
    adapters = ["a", None, "b", "a"]
    want = _run(engines["cpu"], adapters)
    gpu = engines["cuda"]
    assert gpu.runner.decode_graphs is not None
    steps = gpu.runner.num_graph_steps
    assert _run(gpu, adapters) == want
    assert gpu.runner.num_graph_steps > steps
    assert want != _run(engines["cpu"], [None] * 4)  # the adapters change the tokens
