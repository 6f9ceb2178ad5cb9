"""The fused attention prologue (one kernel: q/k norm + RoPE, v norm, K/V cache write) inside the model gives
the tokens of the separate ops. On CUDA the Triton backend hands layers their cache (``kv_write_target``);
here the same backend runs on CPU (kernels in Triton's interpreter) with that hand-over forced on, over the
stacked q/k/v projections the fast path uses, for an E-type model (PLE, KV sharing) and a 31B-type one
(V taken from the raw K projection on full layers)."""

from __future__ import annotations

import pytest

from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.layers.attention import TritonAttention
from g4serve.sampling_params import SamplingParams


def _generate(model_dir, backend: str, fused: bool, monkeypatch) -> dict[str, list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            kv_cache_bytes=16 << 20,
            max_num_seqs=4,
            attention_backend=backend,
            text_only=True,
        )
    )
    calls = []
    if fused:
        engine.model.language_model.fuse_projections()

        def target(self, layer_idx, meta):
            calls.append(layer_idx)
            kv = self.cache.kv[self.kv_source[layer_idx]]
            return kv[0], kv[1], meta.slot_mapping[self.cfg.layer_types[layer_idx]]

        monkeypatch.setattr(TritonAttention, "kv_write_target", target)
    prompts = ["what is my balance", "send forty dollars to maria tomorrow " * 2]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
        engine.add_request(engine.make_request(str(i), engine.process_prompt(prompt), params))
    out = {rid: o.outputs[0].token_ids for rid, o in engine.run_until_finished().items()}
    if fused:
        text = engine.model_config.text
        producers = {i for i in range(text.num_hidden_layers) if i < text.first_kv_shared_layer}
        assert set(calls) == producers  # every KV-producing layer took the fused prologue, no shared one
    return out


@pytest.mark.parametrize("variant", ["e", "31b"])
def test_fused_prologue_gives_the_reference_tokens(hf_checkpoint, variant, monkeypatch):
    model_dir = hf_checkpoint(variant)
    expected = _generate(model_dir, "torch", fused=False, monkeypatch=monkeypatch)
    assert _generate(model_dir, "triton", fused=True, monkeypatch=monkeypatch) == expected
