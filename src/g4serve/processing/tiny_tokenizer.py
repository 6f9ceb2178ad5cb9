"""A tiny Gemma 4-style tokenizer (byte-fallback BPE, Gemma special tokens, chat template) built locally.

``write_tiny_tokenizer`` trains it deterministically in a few milliseconds on an embedded corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from g4serve.processing.tokenizer import GEMMA4_MULTIMODAL_TOKENS, set_gemma_pipeline

# Ids 0..16 in this order; the ``tiny`` preset in g4serve.config hard-codes them.
SPECIAL_TOKENS: list[str] = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|video|>",
]

_CORPUS = """\
The bank opened a new savings account for the customer on Monday, 12 March 2024. The account number is
4021 7788 3310 and the opening balance was $1,250.00. Every month the bank pays interest at a rate of 3.5%
per year, and the statement shows each deposit, withdrawal, transfer and fee. If you want to pay a bill, send
money to a friend or check your balance, you can use the mobile app, the website or any of our 250 branches.
A loan of 10,000 euros over 36 months costs 305.42 per month; the total interest is 994.12. Please keep your
card, PIN and password safe, and never share them with anyone who calls you, even if they say they work for
the bank. Our team will be happy to help you from 9 am to 5 pm, Monday to Friday.

It was a bright, cold day in April, and the clocks were striking thirteen. She said: "What time is it?" and he
answered that it was almost 7 o'clock. They walked to the market, bought some bread, milk, eggs and apples,
and then went home to cook dinner. The quick brown fox jumps over the lazy dog. A model should be able to read
this text, answer a question, write a short story, or think step by step before it gives the final answer.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 2025 and 1000000 appear in many documents.
"""

# Every printable ASCII character plus newline and tab is a learned token; anything else uses byte fallback.
_ALPHABET = ["\u2581", "\n", "\t"] + [chr(c) for c in range(33, 127)]


def build_tiny_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train the tiny BPE: specials (ids 0..16), 256 byte-fallback tokens, the alphabet and merges, then
    ``<unusedN>`` specials up to exactly ``vocab_size`` tokens."""
    n_fixed = len(SPECIAL_TOKENS) + 256
    if vocab_size < n_fixed + len(_ALPHABET):
        raise ValueError(
            f"vocab_size: {vocab_size} is too small; the tiny tokenizer needs at least "
            f"{n_fixed + len(_ALPHABET)} tokens"
        )
    # Train on SentencePiece-style words ("▁word") so no merge spans a word boundary.
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    words = Regex("\u2581*[^\u2581\n]+|\u2581+|\n+")
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(words, behavior="isolated")
    trainer = BpeTrainer(
        vocab_size=vocab_size - n_fixed,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=_ALPHABET,
        limit_alphabet=len(_ALPHABET),
    )
    trainer_tok.train_from_iterator([_CORPUS], trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    learned_tokens = sorted(learned["vocab"], key=learned["vocab"].__getitem__)

    tokens = SPECIAL_TOKENS + [f"<0x{b:02X}>" for b in range(256)] + learned_tokens
    # Like Gemma's reserved <unusedN> tokens, these fill the vocab up to the model's embedding size, so every
    # id a (random) model can sample decodes to something.
    unused = [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens + unused)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    # The pipeline transformers' GemmaTokenizer builds, so transformers and g4serve load it identically.
    set_gemma_pipeline(tok)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + unused])
    # Gemma's tokenizer.json prepends <bos> itself; transformers keeps this post-processor as is.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return tok


def tokenizer_config(model_max_length: int = 4096) -> dict:
    """The tokenizer_config.json that makes transformers load the tiny tokenizer as Gemma 4's."""
    return {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "add_bos_token": True,
        "add_eos_token": False,
        # Named multimodal tokens (image_token, boi_token, ...): transformers' Gemma4Processor reads them.
        "extra_special_tokens": dict(GEMMA4_MULTIMODAL_TOKENS),
        "model_max_length": model_max_length,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
    }


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 1024) -> Path:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``out_dir``; return it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    config = json.dumps(tokenizer_config(), indent=2) + "\n"
    (out / "tokenizer_config.json").write_text(config, encoding="utf-8")
    (out / "chat_template.jinja").write_text(gemma4_chat_template(), encoding="utf-8")
    return out


def gemma4_chat_template() -> str:
    """The Gemma 4 chat template (jinja, transformers conventions) used by the tiny checkpoint."""
    return _CHAT_TEMPLATE


_CHAT_TEMPLATE = """\
{#- Gemma 4 chat format: <bos>, an optional system turn (with <|think|> when thinking is on, and the
    tool list), then <|turn>{role}\\n...<turn|>\\n per message; the assistant role is rendered as `model`. -#}
{%- macro strip_thinking(text) -%}
    {#- Earlier model thoughts (<|channel>thought ... <channel|>) are not fed back to the model. -#}
    {%- set ns = namespace(result='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- if '<|channel>' in part -%}
            {%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
        {%- else -%}
            {%- set ns.result = ns.result + part -%}
        {%- endif -%}
    {%- endfor -%}
    {{- ns.result | trim -}}
{%- endmacro -%}
{%- macro render_content(content, is_model) -%}
    {%- if content is string -%}
        {{- strip_thinking(content) if is_model else (content | trim) -}}
    {%- elif content is iterable -%}
        {%- for item in content -%}
            {%- if item['type'] == 'text' -%}
                {{- strip_thinking(item['text']) if is_model else (item['text'] | trim) -}}
            {%- elif item['type'] == 'image' -%}
                {{- '<|image|>' -}}
            {%- elif item['type'] == 'audio' -%}
                {{- '<|audio|>' -}}
            {%- elif item['type'] == 'video' -%}
                {{- '<|video|>' -}}
            {%- else -%}
                {{- raise_exception('Unsupported content type: ' + item['type'] | string) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set loop_messages = messages -%}
{%- set has_system = messages | length > 0 and messages[0]['role'] in ['system', 'developer'] -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- if thinking or tools or has_system -%}
    {{- '<|turn>system\\n' -}}
    {%- if thinking -%}
        {{- '<|think|>\\n' -}}
    {%- endif -%}
    {%- if has_system -%}
        {{- render_content(messages[0]['content'], false) -}}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}
    {%- if tools -%}
        {%- if has_system -%}
            {{- '\\n\\n' -}}
        {%- endif -%}
        {{- 'You can call the following tools. To call one, reply with a JSON object '
            '{"name": <tool name>, "arguments": <object>}.' -}}
        {%- for tool in tools -%}
            {{- '\\n' + (tool | tojson) -}}
        {%- endfor -%}
    {%- endif -%}
    {{- '<turn|>\\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- set role = message['role'] -%}
    {%- if role in ['assistant', 'model'] -%}
        {%- set role = 'model' -%}
    {%- elif role == 'developer' -%}
        {%- set role = 'system' -%}
    {%- elif role not in ['user', 'system', 'tool'] -%}
        {{- raise_exception('Unknown chat role: ' + role | string) -}}
    {%- endif -%}
    {{- '<|turn>' + role + '\\n' -}}
    {%- set body = '' -%}
    {%- if message['content'] is defined -%}
        {%- set body = render_content(message['content'], role == 'model') -%}
    {%- endif -%}
    {{- body -}}
    {%- if role == 'model' and message['tool_calls'] is defined -%}
        {%- for call in message['tool_calls'] -%}
            {%- set fn = call['function'] if call['function'] is defined else call -%}
            {%- if body or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {#- OpenAI sends arguments as a JSON string: keep it as JSON rather than quoting it again. -#}
            {%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}
            {{- '{"name": ' + (fn['name'] | tojson) + ', "arguments": ' + args + '}' -}}
        {%- endfor -%}
    {%- endif -%}
    {{- '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\\n' -}}
{%- endif -%}
"""

__all__ = [
    "SPECIAL_TOKENS",
    "build_tiny_tokenizer",
    "gemma4_chat_template",
    "tokenizer_config",
    "write_tiny_tokenizer",
]
