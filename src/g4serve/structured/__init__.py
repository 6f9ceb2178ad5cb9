"""Constrained decoding: OpenAI ``response_format`` (JSON object / JSON Schema) plus regex, choice and
EBNF grammars, compiled with xgrammar into per-request matchers that mask the sampler's logits.

Importing this package is cheap; xgrammar (and jsonschema) load on first use.
"""

from g4serve.structured.backend import StructuredMatcher, StructuredOutputBackend, detect_vocab_type
from g4serve.structured.bitmask import AllowedTokenMasks, build_allowed_mask, unpack_bitmask
from g4serve.structured.spec import StructuredOutputError, StructuredSpec

__all__ = [
    "AllowedTokenMasks",
    "StructuredMatcher",
    "StructuredOutputBackend",
    "StructuredOutputError",
    "StructuredSpec",
    "build_allowed_mask",
    "detect_vocab_type",
    "unpack_bitmask",
]
