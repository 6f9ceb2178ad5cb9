"""Constrained decoding on CUDA (``-m gpu``): the pinned bitmask buffer, its asynchronous copy and the
on-device unpacking give valid output and the same masks as the CPU."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from g4serve.sampling_params import SamplingParams
from g4serve.structured import StructuredSpec, unpack_bitmask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_unpack_on_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, 8192), dtype=torch.int32, generator=gen)
    assert torch.equal(unpack_bitmask(bitmask.cuda(), 262144).cpu(), unpack_bitmask(bitmask, 262144))


def test_engine_on_cuda(tiny_model_dir):
    from test_structured_engine import PROMPT, SCHEMA, make_engine, run

    engine = make_engine(tiny_model_dir, device="cuda")
    spec = StructuredSpec.json_schema(SCHEMA)
    requests = {
        f"j{seed}": (
            PROMPT,
            SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_output=spec),
        )
        for seed in range(12)
    }
    requests["obj"] = (
        PROMPT,
        SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredSpec.json_object()),
    )
    requests["free"] = (PROMPT, SamplingParams(temperature=0, max_tokens=16))
    results = run(engine, requests)
    for seed in range(12):
        assert results[f"j{seed}"].finish_reason == "stop"
        jsonschema.validate(json.loads(results[f"j{seed}"].text), SCHEMA)
    assert isinstance(json.loads(results["obj"].text), dict) and len(results["obj"].token_ids) <= 40
    assert engine.runner.token_masks._buffer.is_pinned()
