"""Hostile adapter files under ``--lora-root``: each is refused by name (a ``LoRAAdapterError``, which the
server answers with a 400), fast, and without holding up the rest of the process; the registry refuses a load
before anything is read when no slot is free."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from adapter_files import CONFIG, LM, Q0, edit_config, edit_weights

from g4serve import LLM
from g4serve.lora import LoRAAdapterError, load_peft_adapter, patterns


def _load(path, cfg, dtype=torch.float32):
    return load_peft_adapter(path, cfg, 8, dtype, confine_to=path.parent)


def _timed_load(path, cfg) -> tuple[float, float, BaseException | None]:
    """(seconds the load took, the longest another thread waited to run meanwhile, what the load raised)."""
    gaps, done = [0.0], threading.Event()

    def other_thread():  # what the event loop and the engine thread do while a load runs in the pool
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    watcher = threading.Thread(target=other_thread)
    watcher.start()
    t0, error = time.monotonic(), None
    try:
        _load(path, cfg)
    except Exception as exc:
        error = exc
    elapsed = time.monotonic() - t0
    done.set()
    watcher.join()
    return elapsed, max(gaps), error


def test_a_deeply_nested_config_is_a_config_error(adapter):
    path, cfg = adapter
    (path / CONFIG).write_text("[" * 100_000 + "]" * 100_000)  # 200 kB, under the size cap
    with pytest.raises(LoRAAdapterError, match="adapter_config.json: nested too deeply"):
        _load(path, cfg)


@pytest.mark.parametrize("pattern", [r"(.|.)*[0-9]", r"(\w|\w|.)*\.(.|.)*!"])
def test_a_backtracking_alpha_pattern_neither_hangs_nor_stalls_the_process(adapter, pattern):
    """PEFT matches ``alpha_pattern`` keys as regexes against module names: a key that backtracks without end
    ran the stdlib matcher for hours (2^47 steps on a 47-character name) with the interpreter lock held, so
    the server's event loop and engine thread stopped with it. Now it is matched under a time budget, and
    the lock is released while it runs."""
    path, cfg = adapter
    edit_config(path, alpha_pattern={pattern: 2.0})
    elapsed, longest_gap, error = _timed_load(path, cfg)
    assert isinstance(error, LoRAAdapterError) and "alpha_pattern" in str(error), error
    assert elapsed < 2.5 and longest_gap < 0.5, (elapsed, longest_gap)


def test_many_alpha_patterns_are_refused_before_matching(adapter):
    """20,000 keys (a 1 MB config) took 74 s of CPU: every (key, module) pair compiled its regex anew."""
    path, cfg = adapter
    edit_config(path, alpha_pattern={f"layers.{i}.zz": 1.0 for i in range(5000)})
    t0 = time.monotonic()
    with pytest.raises(LoRAAdapterError, match="alpha_pattern: 5000 keys; at most 1024"):
        _load(path, cfg)
    assert time.monotonic() - t0 < 0.5


def test_alpha_patterns_share_a_time_budget(adapter, monkeypatch):
    """1,024 keys each at the bound of its ways to match (~0.75 ms a name here) would take ~60 s over the 76
    modules; all matching of one adapter shares ``MATCH_BUDGET_S`` (cut to 0.2 s here)."""
    path, cfg = adapter
    monkeypatch.setattr(patterns, "MATCH_BUDGET_S", 0.2)
    edit_config(path, alpha_pattern={"(.|.)" * 12 + f"[0-9]|x{i}": 1.0 for i in range(1024)})
    elapsed, longest_gap, error = _timed_load(path, cfg)
    assert isinstance(error, LoRAAdapterError), error
    assert "alpha_pattern: matching its 1024 keys took over 0.2 s" in str(error)
    # far under the ~60 s without the budget, with room for a loaded machine (a fresh-clone run read 1.07 s)
    assert elapsed < 3.0 and longest_gap < 0.5, (elapsed, longest_gap)


@pytest.mark.parametrize(
    "key,message",
    [
        ("(" * 50_000 + ")" * 50_000, "alpha_pattern: a key of 100000 characters; at most 256"),
        ("(.|.)" * 13 + "[0-9]", "has too many ways to match a name (8192 > 4225"),
        (".*" * 3 + "q_proj", "has too many ways to match a name (274625 > 4225"),
        (r"(\w+\.)*q_proj", "repeats a group"),
        (r"(?=q)q_proj", "uses a look-around"),
        (r"(q)\1_proj", "back-reference"),
        ("q_proj(", "is not a regex"),
        ("a{99999999999}", "is not a regex"),
    ],
)
def test_bad_alpha_pattern_keys(adapter, key, message):
    path, cfg = adapter
    edit_config(path, alpha_pattern={key: 2.0})
    with pytest.raises(LoRAAdapterError, match=message.replace("(", r"\(")):
        _load(path, cfg)


def test_literal_and_regex_alpha_patterns_scale_as_peft_does(adapter):
    """First matching key wins; a key names the module or a dotted suffix of it, its dots any character."""
    path, cfg = adapter
    base = _load(path, cfg).weights
    edit_config(
        path,
        alpha_pattern={
            "layers.1.self_attn.q_proj": 16.0,  # a literal dotted suffix: layer 1's q only
            "q_proj": 4.0,  # every other q_proj
            "layers.1.mlp.up.proj": 32.0,  # '.' matches '_': up_proj of layer 1
            r"layers\.[23]\.mlp\.down_proj": 2.0,
            "attn.o_proj": 1.0,  # not a suffix at a dot ("self_attn.o_proj"): matches nothing
        },
    )
    got = _load(path, cfg).weights

    def ratio(layer, module):  # the new scale over the old (lora_alpha 8)
        return float(got[layer, module][1].abs().sum() / base[layer, module][1].abs().sum())

    assert ratio(1, "q_proj") == pytest.approx(2.0)
    assert ratio(0, "q_proj") == pytest.approx(0.5) and ratio(5, "q_proj") == pytest.approx(0.5)
    assert ratio(1, "up_proj") == pytest.approx(4.0) and ratio(0, "up_proj") == pytest.approx(1.0)
    assert ratio(2, "down_proj") == pytest.approx(0.25) and ratio(4, "down_proj") == pytest.approx(1.0)
    assert ratio(0, "o_proj") == pytest.approx(1.0)


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.int8, torch.bool, torch.uint16], ids=lambda d: str(d)[6:]
)
def test_weights_of_a_non_float_dtype_are_refused(adapter, dtype):
    """float8_e4m3fn raised NotImplementedError from the finiteness check (a 500); integer and boolean
    tensors were cast and served."""
    path, cfg = adapter
    edit_weights(path, lambda t: t.update({f"{Q0}.lora_A.weight": t[f"{Q0}.lora_A.weight"].to(dtype)}))
    with pytest.raises(LoRAAdapterError, match=f"lora_A.weight: dtype {str(dtype)[6:]}: expected"):
        _load(path, cfg)


@pytest.mark.parametrize(
    "change,dtype",
    [(dict(lora_alpha=1e300), torch.float32), (dict(lora_alpha=1e6), torch.float16)],
    ids=["fp32", "fp16"],
)
def test_weights_that_overflow_once_scaled_are_refused(adapter, change, dtype):
    """Finite weights and a finite ``lora_alpha`` whose product, folded into B in the serving dtype, is
    infinite: every token of the adapter's requests came out NaN."""
    path, cfg = adapter
    edit_config(path, **change)
    with pytest.raises(LoRAAdapterError, match="NaN or infinite values once scaled by lora_alpha"):
        _load(path, cfg, dtype)


def test_a_zero_rank_module_is_named_as_such(adapter):
    path, cfg = adapter
    edit_weights(
        path,
        lambda t: t.update(
            {f"{Q0}.lora_A.weight": torch.zeros(0, 64), f"{Q0}.lora_B.weight": torch.zeros(64, 0)}
        ),
    )
    with pytest.raises(LoRAAdapterError, match="q_proj: rank 0: an adapter's rank is at least 1"):
        _load(path, cfg)


@pytest.mark.parametrize(
    "layer", ["00", "0" * 5000 + "1", "\u0661"], ids=["zeros", "5000-digits", "arabic-1"]
)
def test_a_layer_index_must_be_written_as_peft_writes_it(adapter, layer):
    """``layers.0000…1`` made module names as long as the header allows (and int() past 4,300 digits
    raised); ``layers.١`` (Arabic-Indic one) was read as layer 1."""
    path, cfg = adapter
    edit_weights(path, lambda t: t.update({f"{LM}.{layer}.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}))
    with pytest.raises(LoRAAdapterError, match="not a LoRA weight of a decoder projection"):
        _load(path, cfg)


def test_lora_alpha_defaults_as_in_peft(adapter):
    """PEFT's ``LoraConfig.lora_alpha`` defaults to 8 whatever ``r`` is (it was taken as ``r`` here)."""
    path, cfg = adapter
    edit_config(path, r=4, lora_alpha=8)
    explicit = _load(path, cfg).weights
    config = json.loads((path / CONFIG).read_text())
    del config["lora_alpha"]
    (path / CONFIG).write_text(json.dumps(config))
    default = _load(path, cfg).weights
    assert all(torch.equal(default[k][1], explicit[k][1]) for k in explicit)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(use_rslora="false"), "use_rslora: expected true or false, got 'false'"),
        (dict(modules_to_save=["x" * 100] * 10_000), "modules_to_save: adapters that replace whole"),
    ],
)
def test_config_fields_of_the_wrong_type(adapter, change, message):
    path, cfg = adapter
    edit_config(path, **change)
    with pytest.raises(LoRAAdapterError, match=message) as info:
        _load(path, cfg)
    assert len(str(info.value)) < 300  # the field's value is not echoed back whole


def test_a_path_too_long_to_open_is_an_adapter_error(adapter):
    path, cfg = adapter
    with pytest.raises(LoRAAdapterError, match="cannot be opened"):
        _load(path / ("a" * 5000), cfg)


def test_no_free_slot_is_known_before_the_adapter_is_read(lora_adapter):
    """The name check the async engine runs before it reads an adapter (in the preprocessing pool) also
    refuses when every slot is taken: a full server read each refused adapter whole (up to the largest a
    slot holds: ~1.9 GB for 31B at rank 64, fp32) before saying so."""
    base, path, _ = lora_adapter("all")
    llm = LLM(base, device="cpu", text_only=True, kv_cache_bytes=4 << 20, enable_lora=True, max_loras=1)
    registry = llm.engine.lora_registry()
    registry.check_name("a")
    llm.engine.load_lora("a", str(path))
    with pytest.raises(ValueError, match="lora_name: all 1 adapter slots are in use"):
        registry.check_name("b")
