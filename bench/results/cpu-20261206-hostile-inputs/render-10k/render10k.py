"""One render of the model's chat template over 10,000 one-word messages (no warm-up but a 2-message render
that compiles the template), as bench/hostile_inputs.py builds them; prints the seconds and the commit."""
import subprocess, time
from g4serve.engine.engine import EngineConfig, LLMEngine
tok = LLMEngine(EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=32 << 20)).tokenizer
turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(10_000)]
tok.apply_chat_template(turns[:2])
began = time.perf_counter()
tok.apply_chat_template(turns)
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"commit {commit}: 10,000 messages rendered in {time.perf_counter() - began:.1f} s")
