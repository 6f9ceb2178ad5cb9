"""One request's parameters and inputs cannot fail another's step: what a client may send (and what the model
may answer it) runs beside a plain request, which must get exactly its tokens, with every KV block back."""

from __future__ import annotations

import pytest
from test_engine import assert_pools_free, make_engine  # tests/engine is on sys.path

from g4serve.sampling_params import SamplingParams
from g4serve.structured import StructuredSpec

PLAIN = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PLAIN_PROMPT = "balance transfer card savings"


@pytest.fixture(scope="module")
def ngram_engine(tiny_model_dir):
    return make_engine(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def _plain_alone(engine) -> list[int]:
    engine.add_request(engine.make_request("alone", engine.process_prompt(PLAIN_PROMPT), PLAIN))
    return engine.run_until_finished()["alone"].outputs[0].token_ids


def test_a_drafted_end_of_grammar_fails_no_step(ngram_engine):
    """Prompt lookup drafts what followed the output's last tokens in the prompt: in a chat prompt every turn
    ends in an EOS id (Gemma 4's ``<turn|>``), so a constrained answer that repeats the end of a turn gets the
    EOS as a draft once its grammar is complete. The verifying step then filled the mask of the row after it
    from a terminated matcher: xgrammar raised, and every request of the step failed with a 500."""
    engine = ngram_engine
    expected = _plain_alone(engine)
    eos = engine.model_config.text.eos_token_ids[0]
    ab = engine.tokenizer.encode("ab", add_special_tokens=False)
    prompt = [2, *ab, eos, *ab, eos, 20, 30]  # "ab" then EOS, twice: the lookup drafts EOS after "ab"
    constrained = SamplingParams(temperature=0, max_tokens=8, structured_output=StructuredSpec.regex("ab"))
    engine.add_request(engine.make_request("plain", engine.process_prompt(PLAIN_PROMPT), PLAIN))
    engine.add_request(
        engine.make_request("constrained", engine.process_prompt({"prompt_token_ids": prompt}), constrained)
    )
    outputs = engine.run_until_finished()
    assert outputs["plain"].error is None
    assert outputs["plain"].outputs[0].token_ids == expected
    assert outputs["constrained"].error is None
    assert outputs["constrained"].outputs[0].token_ids == [*ab, eos]
    assert outputs["constrained"].outputs[0].finish_reason == "stop"
    assert_pools_free(engine)
