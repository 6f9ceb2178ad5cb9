"""`bench/gemv_kernels.py --quant` on the CPU: the shapes each preset quantizes, the sweep's tiles (each a
valid quant_matmul config; the distinct tiles run in Triton's interpreter against the reference), the opt-in
split-K against the reference, the parallel compile's jobs and worker, and a whole ``--quant --sweep`` run on
the tiny preset with the device timing replaced (the JSON, the best tiles per row tile, the python dict)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from bench_scripts import BENCH, load_script

from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN
from g4serve.kernels.quant_matmul import _groups_per_tile, quant_matmul, quant_matmul_reference

script = load_script("gemv_kernels")
SM_COUNT = 132  # an H100 SXM
ROWS = (1, 2, 4, 8)


def _grid(preset: str, quant: str, rows=ROWS) -> dict:
    wq = script.QUANTIZATION_PRESETS[quant].groups[0].weights
    return {
        (name, ep, n, k, m): script.sweep_configs(
            m, n, k, ep, script.scale_block(wq, ep, n, k)[1], SM_COUNT, wq.kind == script.INT4
        )
        for name, ep, n, k, _ in script.quant_shapes(preset)
        for m in rows
    }


def test_quant_shapes_leave_out_the_lm_head_and_the_experts():
    e4b = script.quant_shapes("e4b")
    assert "lm_head" not in {s[0] for s in e4b}
    assert {s[0] for s in e4b} == {
        "qkv",
        "q",
        "o",
        "gate_up",
        "down",
        "ple_gate",
        "ple_proj",
        "ple_model_proj",
    }
    assert len({(ep, n, k) for _, ep, n, k, _ in e4b}) == len(e4b)  # deduplicated
    # every layer's four projections once a step (e4b: 42 layers, 18 sharing KV: q only)
    assert sum(c for name, *_, c in e4b if name in ("qkv", "q")) == 42
    assert sum(c for name, *_, c in e4b if name == "down") == 42
    big = script.quant_shapes("31b")
    assert {(name, n, k) for name, _, n, k, _ in big} >= {("gate_up", 21504, 5376), ("down", 5376, 21504)}
    moe = script.quant_shapes("26b-a4b")  # the dense MLP beside the experts; experts are not in the list
    assert ("gate_up", GATE_UP, 2112, 2816, 30) in moe
    assert all(k in (2816, 2112, 4096, 8192) for *_, k, _ in moe)


def test_scale_blocks_follow_the_engine_stacking():
    wq = {q: script.QUANTIZATION_PRESETS[q].groups[0].weights for q in script.QUANTIZATION_PRESETS}
    assert script.scale_block(wq["fp8"], PLAIN, 3072, 2560) == (1, 2560)
    assert script.scale_block(wq["fp8-block"], GATE_UP, 10240, 2560) == (128, 128)
    assert script.scale_block(wq["fp8-block"], GATE_UP, 2112, 2816) == (1, 128)  # 128 does not tile 2112
    assert script.scale_block(wq["w4a16"], PLAIN, 2560, 256) == (1, 128)
    assert script.scale_block(wq["w4a16-g32"], MUL, 256, 2560) == (1, 32)


@pytest.mark.parametrize("preset", ["e4b", "31b", "26b-a4b"])
@pytest.mark.parametrize("quant", sorted(script.QUANTIZATION_PRESETS))
def test_every_swept_config_is_a_valid_quant_matmul_config(preset, quant):
    wq = script.QUANTIZATION_PRESETS[quant].groups[0].weights
    for (name, ep, n, k, m), configs in _grid(preset, quant, (1, 2, 4, 8, 16, 33, 64)).items():
        # the default is always timed
        assert configs[0] == script.default_config(m, n, k, ep, wq.kind == script.INT4, SM_COUNT)
        assert len({json.dumps(c, sort_keys=True) for c in configs}) == len(configs), (name, m)
        bk_scale = script.scale_block(wq, ep, n, k)[1]
        for cfg in configs:
            assert set(cfg) <= {"block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k"}
            tile = 1 if m == 1 else max(16, 1 << (m - 1).bit_length())
            # int4 also times its row tiles at one row (the tensor cores on a 16-row tile)
            assert (
                cfg["block_m"] in ({tile, 16} if wq.kind == script.INT4 else {tile})
                and script.row_tile(m) == tile
            )
            for key in ("block_n", "block_k", "num_warps"):
                assert cfg[key] & (cfg[key] - 1) == 0, (key, cfg)
            groups = _groups_per_tile(cfg["block_k"], bk_scale, k)  # asserts the tiles nest
            assert cfg["block_k"] % groups == 0 and cfg["block_k"] % 8 == 0
            split = cfg.get("split_k", 1)
            if split > 1:
                per_split = -(-(-(-k // split)) // cfg["block_k"]) * cfg["block_k"]
                assert (split - 1) * per_split < k, cfg  # no empty split
                assert -(-n // cfg["block_n"]) < 2 * SM_COUNT
            if cfg["block_m"] == 1:
                elems = cfg["block_n"] * cfg["block_k"] // (32 * cfg["num_warps"])
                assert cfg == configs[0] or 16 <= elems <= (32 if ep == GATE_UP else 64)
                assert cfg["block_k"] <= max(256, 1 << (k - 1).bit_length())


def test_grid_sizes_fit_the_device_budget():
    """~40 tiles per shape at one row (the brief of bench/device/quant_sweep.sh), ~42 + split-K with more."""
    assert 35 <= len(script.M1_TILES) + 2 * len(script.M1_STAGED) <= 48
    assert len(script.DOT_TILES) * len(script.DOT_STAGES) <= 54
    for preset in ("e4b", "31b"):
        for (name, _, _, k, m), configs in _grid(preset, "fp8").items():
            plain = [c for c in configs if "split_k" not in c]
            assert len(plain) <= 48 if m == 1 else len(plain) <= 43, (name, m, len(plain))
            assert len(configs) <= 62, (name, m, len(configs))
        jobs = script.compile_jobs("fp8", script.quant_shapes(preset), list(ROWS), _configs_by_shape(preset))
        # rows 2, 4, 8 share one row tile and one specialisation of M: compiled once
        assert len(jobs) < sum(len(v) for (_, _, _, _, m), v in _grid(preset, "fp8").items() if m in (1, 8))


def _configs_by_shape(preset: str, quant: str = "fp8") -> dict:
    return {(ep, n, k, m): v for (_, ep, n, k, m), v in _grid(preset, quant).items()}


def test_lead_rows_run_the_full_grid():
    assert script.lead_rows([1, 2, 4, 8]) == {1: 1, 2: 8, 4: 8, 8: 8}
    assert script.row_order([1, 2, 4, 8]) == [1, 8, 2, 4]
    assert script.lead_rows([8, 32, 20]) == {8: 8, 32: 32, 20: 32}
    assert script.row_order([4, 1, 32, 20]) == [1, 4, 32, 20]


def _random_quantized(
    kind: str, rows: int, k: int, block: tuple[int, int], zeros: bool, gen: torch.Generator
):
    """Random quantized tensors in quant_matmul's layout (every bit pattern of the int4 words), outputs of
    order one."""
    grid = (-(-rows // block[0]), -(-k // block[1]))
    scale = (torch.rand(grid, generator=gen) + 0.5) * (0.01 if kind == "fp8" else 0.2) / k**0.5
    if kind == "fp8":
        weight = (torch.randn(rows, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return weight, scale, None
    weight = torch.randint(-(2**31), 2**31 - 1, (rows, -(-k // 8)), generator=gen, dtype=torch.int64)
    zero = torch.randint(-8, 8, grid, generator=gen).to(torch.int8) if zeros else None
    return weight.to(torch.int32), scale, zero


def _distinct_tiles() -> list[dict]:
    """Each distinct tile shape (block_m, block_n, block_k, split_k) the e4b and 31b sweeps time, with its
    tightest scale group; warps and stages do not change what the interpreter computes."""
    tiles = {}
    for preset in ("e4b", "31b"):
        for quant in ("fp8", "w4a16-g32"):
            for configs in _grid(preset, quant).values():
                for cfg in configs:
                    key = (cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg.get("split_k", 1))
                    tiles.setdefault(key, cfg)
    return list(tiles.values())


TILES = _distinct_tiles()


@pytest.mark.parametrize(
    "index", range(0, len(TILES), 1), ids=lambda i: "-".join(map(str, TILES[i].values()))
)
def test_swept_tiles_match_the_reference_in_the_interpreter(index):
    """Every distinct tile of the sweep on a small ragged problem (fp8 per channel and int4 groups of 32 in
    turn, the gated epilogues on some): the output against dequantize + F.linear."""
    cfg = TILES[index]
    kind, block = ("fp8", (1, 320)) if index % 2 else ("int4", (1, 32))
    ep = (PLAIN, GATE_UP, MUL)[index % 3]
    m = 1 if cfg["block_m"] == 1 else 3
    n, k = 20, 320
    gen = torch.Generator().manual_seed(index)
    weight, scale, zero = _random_quantized(
        kind, 2 * n if ep == GATE_UP else n, k, block, index % 4 == 1, gen
    )
    x = torch.randn(m, k, generator=gen)
    other = torch.randn(m, n, generator=gen) if ep == MUL else None
    act = "gelu_pytorch_tanh" if ep != PLAIN else None
    out = quant_matmul(x, weight, scale, block, k, zero, ep, act, other, config=cfg)
    ref = quant_matmul_reference(x, weight, scale, block, k, zero, ep, act, other)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


SPLIT_CASES = [
    # kind, m, n, k, scale block, zero points, (block_m, block_n, block_k), split_k
    ("fp8", 1, 24, 200, (1, 200), False, (1, 8, 32), 3),  # ragged K: splits of 96, 96, 8
    ("fp8", 1, 24, 64, (1, 64), False, (1, 4, 32), 4),  # two empty splits
    ("int4", 1, 20, 128, (1, 32), True, (1, 8, 64), 2),  # zero points, two groups per K tile
    ("int4", 3, 20, 96, (1, 32), True, (16, 16, 32), 2),  # the row tile
    ("fp8", 5, 40, 96, (16, 32), False, (16, 16, 32), 3),  # blocks, partial row block
]


@pytest.mark.parametrize("epilogue", [PLAIN, GATE_UP, MUL])
@pytest.mark.parametrize("kind,m,n,k,block,zeros,tiles,split", SPLIT_CASES)
def test_split_k_matches_the_reference(kind, m, n, k, block, zeros, tiles, split, epilogue):
    """``config["split_k"]``: fp32 partials summed in split order, then the epilogue; ``split_k: 1`` is the
    kernel without the key, bit for bit."""
    gen = torch.Generator().manual_seed(m * 100 + n + k)
    rows = 2 * n if epilogue == GATE_UP else n
    weight, scale, zero = _random_quantized(kind, rows, k, block, zeros, gen)
    x = torch.randn(m, k, generator=gen)
    other = torch.randn(m, n, generator=gen) if epilogue == MUL else None
    act = "gelu_pytorch_tanh" if epilogue != PLAIN else None
    block_m, block_n, block_k = tiles
    cfg = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 1}
    out = quant_matmul(
        x, weight, scale, block, k, zero, epilogue, act, other, config={**cfg, "split_k": split}
    )
    ref = quant_matmul_reference(x, weight, scale, block, k, zero, epilogue, act, other)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    one = quant_matmul(x, weight, scale, block, k, zero, epilogue, act, other, config={**cfg, "split_k": 1})
    assert torch.equal(one, quant_matmul(x, weight, scale, block, k, zero, epilogue, act, other, config=cfg))


def test_compile_inputs_are_laid_out_as_the_timed_weights():
    for quant in script.QUANTIZATION_PRESETS:
        for ep, n, k in ((GATE_UP, 48, 96), (PLAIN, 40, 200), (MUL, 16, 64)):
            script._compile_inputs.cache_clear()
            (q, scale, zero), block = script._compile_inputs(quant, ep, n, k, "cpu")
            weights, block_timed, nbytes = script.quantized_weights(quant, ep, n, k, copies=2, device="cpu")
            assert block == block_timed and len(weights) == 2
            for a, b in zip((q, scale, zero), weights[0], strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), quant
            assert nbytes == sum(t.numel() * t.element_size() for t in weights[0] if t is not None)


def test_compile_jobs_and_worker():
    shapes = [("o", PLAIN, 40, 96, 1), ("gate_up", GATE_UP, 24, 64, 1), ("ple_gate", MUL, 16, 64, 1)]
    configs = {
        (ep, n, k, m): script.sweep_configs(m, n, k, ep, 32, SM_COUNT)[:3]
        for _, ep, n, k, _ in shapes
        for m in ROWS
    }
    jobs = script.compile_jobs("w4a16-g32", shapes, list(ROWS), configs)
    # rows 2, 4 and 8 specialise alike (not 1, not a multiple of 16): their kernels are compiled once
    assert {m for _, m, _ in jobs} == {1, 2}
    assert len(jobs) == sum(len(configs[(ep, n, k, m)]) for _, ep, n, k, _ in shapes for m in (1, 2))
    done, errors = script.compile_task(jobs[:4], "gelu_pytorch_tanh", device="cpu")
    assert (done, errors) == (4, [])


def test_bf16_sweep_grid_and_compile_jobs():
    """The bf16 sweep (kernels/gemv.py): swapped tiles at 9-64 rows, split only where the column tiles leave
    SMs idle, no pipeline past the shared-memory cap; its compile jobs run the skinny kernel."""
    for m, ep, n, k in ((32, GATE_UP, 10240, 2560), (64, PLAIN, 2560, 10240), (16, MUL, 256, 2560)):
        grid = script._configs(m, ep, n, k, SM_COUNT)
        swapped = [c for c in grid if c.get("swap_ab")]
        assert swapped and all(c["block_m"] >= m for c in swapped)
        weights = 2 if ep == GATE_UP else 1
        assert all(
            c["num_stages"] * (weights * c["block_n"] + c["block_m"]) * c["block_k"] * 2
            <= script.SHARED_BYTES
            for c in swapped
        )
        for c in swapped:
            if c.get("split_k", 1) > 1:
                assert -(-n // c["block_n"]) * c["split_k"] <= 4 * SM_COUNT
        assert any(c.get("split_k", 1) > 1 for c in swapped)
        assert (m <= 16) == any("swap_ab" not in c for c in grid)
    # 31B's o and down (84 column tiles) may split 3 ways, about two waves of 132 SMs
    assert any(c.get("split_k") == 3 for c in script._configs(16, PLAIN, 5376, 21504, 132))
    # the LM head's 4,096 column tiles fill every SM: never split
    assert not any(c.get("split_k", 1) > 1 for c in script._configs(64, PLAIN, 262144, 2560, SM_COUNT))
    shapes = [("o", PLAIN, 40, 96, 1), ("gate_up", GATE_UP, 24, 64, 1)]
    configs = {
        (ep, n, k, m): [
            {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 1, "swap_ab": 1},
            {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 1, "swap_ab": 1,
             "split_k": 2},
        ]
        for _, ep, n, k, _ in shapes
        for m in (9, 12)
    }  # fmt: skip
    jobs = script.compile_jobs(None, shapes, [9, 12], configs)
    assert len(jobs) == 4  # one row specialisation, split or not
    assert script.compile_task(jobs, "gelu_pytorch_tanh", device="cpu") == (4, [])


def test_precompile_runs_in_spawned_workers(monkeypatch):
    """The process pool as the device runs it (spawned workers importing the script), on the CPU."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setitem(sys.modules, "gemv_kernels", script)
    jobs = [
        (
            ("fp8", PLAIN, 24, 64),
            1,
            {"block_m": 1, "block_n": 8, "block_k": 256, "num_warps": 4, "num_stages": 1},
        )
    ]
    jobs.append((("fp8", PLAIN, 24, 64), 2, script.quant_matmul_config(2, 24, 64)))
    report = script.precompile(jobs, "gelu_pytorch_tanh", workers=2, device="cpu", per_task=1)
    assert report["launched"] == 2 and report["errors"] == []


def test_best_configs_python_is_a_dict_to_paste():
    results = []
    for m, times in ((2, (3.0, 1.0, 2.0)), (8, (3.5, 2.5, 1.0))):
        trials = [{"config": {"block_m": 16, "block_n": bn}, "ms": t} for bn, t in zip((16, 32, 64), times)]
        results.append(
            {
                "name": "o",
                "epilogue": "plain",
                "n": 2560,
                "k": 2048,
                "rows": m,
                "row_tile": 16,
                "quant_ms": times[0],
                "sweep": {"trials": trials + [{"config": {"block_m": 16, "block_n": 8}, "error": "X"}]},
            }
        )
    (entry,) = script.bucket_best("fp8", results)
    # the least summed over M = 2 and 8 (64 columns: 3.0 ms; 32: 3.5; 16: 6.5), not M=2's best (32)
    assert entry["config"] == {"block_m": 16, "block_n": 64}
    assert entry["best_ms_sum"] == 3.0 and entry["default_ms_sum"] == 6.5 and entry["rows"] == [2, 8]
    source = script.best_configs_python([entry, {**entry, "m_bucket": 1, "config": {"block_m": 1}}])
    scope: dict = {}
    exec(source, scope)
    assert scope["QUANT_MATMUL_CONFIGS"] == {
        ("fp8", 1, 2560, 2048): {"block_m": 1},
        ("fp8", 16, 2560, 2048): entry["config"],
    }


def _fake_device(monkeypatch):
    """The device timing replaced: each timed call runs once (interpreted), with a made-up time."""
    timed = []

    def fake_graph_ms(calls, min_calls, replays):
        calls[0]()
        timed.append(len(calls))
        return 1e-3 * (1 + (len(timed) * 7919 % 97) / 97)

    monkeypatch.setattr(script, "_graph_ms", fake_graph_ms)
    monkeypatch.setattr(script, "copy_gb_per_s", lambda nbytes, device="cuda": 3000.0)
    shapes = [s for s in script.quant_shapes("tiny") if s[0] in ("gate_up", "ple_gate", "down")]
    monkeypatch.setattr(script, "quant_shapes", lambda preset: shapes)
    return shapes


def _run(tmp_path, argv: list[str]) -> dict:
    args = script.parse_args(["--preset", "tiny", *argv, "--stream-mb", "0", "--out-dir", str(tmp_path)])
    env = {"device_name": "CPU test", "device_sm_count": SM_COUNT}
    assert script.run_quant(args, env, device="cpu") == 0
    (path,) = tmp_path.glob(f"gemv_kernels_*_tiny_{args.quant}.json")
    return json.loads(path.read_text())


def test_quant_sweep_run_on_the_tiny_preset(tmp_path, monkeypatch):
    """``main``'s --quant path end to end on the CPU (interpreted kernels), the device timing replaced by a
    fake clock: rows in two row tiles, the lead's full grid, the others' top configs, the JSON."""
    shapes = _fake_device(monkeypatch)
    doc = _run(tmp_path, ["--quant", "w4a16", "--rows", "1", "2", "4", "--sweep", "--sweep-top", "2"])
    assert doc["complete"] and doc["quant"] == "w4a16" and doc["weight_kind"] == "int4"
    assert doc["copy_gb_per_s"] == 3000.0
    assert len(doc["results"]) == 3 * len(shapes)
    for r in doc["results"]:
        ep = {name: ep for ep, name in script.EPILOGUE_NAMES.items()}[r["epilogue"]]
        assert r["quant_config"] == script.default_config(r["rows"], r["n"], r["k"], ep, True, 132)
        assert r["weight_copies"] == 2 and r["quant_gb_per_s"] > 0 and r["bf16_skinny_ms"] is not None
        # torch's int4 kernel beside it where it has a layout for the shape (the stacked gate_up: [2N, K])
        rows = 2 * r["n"] if r["epilogue"] == "gate_up+act" else r["n"]
        has_layout = script.tinygemm_supported(rows, r["k"], tuple(r["scale_block"]))
        assert (r["tinygemm_ms"] is not None) == has_layout
        sweep = r["sweep"]
        assert sweep["full_grid"] == (r["rows"] in (1, 4))
        if not sweep["full_grid"]:  # M=2 times the M=4 lead's best two and the default
            assert len(sweep["trials"]) <= 3
        assert sweep["best_ms"] == min(t["ms"] for t in sweep["trials"])
        assert {"config": r["quant_config"], "ms": r["quant_ms"]} in sweep["trials"]  # timed once
    assert {(e["name"], e["m_bucket"]) for e in doc["best_configs"]} == {
        (s[0], t) for s in shapes for t in (1, 16)
    }
    assert all(e["best_ms_sum"] <= e["default_ms_sum"] for e in doc["best_configs"])
    scope: dict = {}
    exec(doc["best_configs_python"], scope)
    assert len(scope["QUANT_MATMUL_CONFIGS"]) == 2 * len(shapes)
    assert set(doc["step_totals"]) == {"1", "2", "4"}
    assert all(t["quant_chosen_us"] >= t["quant_best_us"] for t in doc["step_totals"].values())


def test_quant_run_without_sweep(tmp_path, monkeypatch):
    shapes = _fake_device(monkeypatch)
    doc = _run(tmp_path, ["--quant", "fp8-block", "--rows", "1", "3"])
    assert doc["complete"] and doc["weight_strategy"] == "block" and doc["best_configs"] == []
    assert [r["rows"] for r in doc["results"]] == [1, 3] * len(shapes)
    for r in doc["results"]:  # 128 x 128 blocks; per row where 128 does not tile N (ple_gate: 16)
        assert r["tinygemm_ms"] is None  # an int4 kernel only
        assert "sweep" not in r and r["scale_block"] == [128 if r["n"] % 128 == 0 else 1, 128]
    assert set(doc["step_totals"]["3"]) == {
        "quant_default_us",
        "bf16_cublas_us",
        "bf16_skinny_us",
        "quant_bytes",
    }


@pytest.mark.parametrize(
    "int4,epilogue,block_m", [(False, GATE_UP, 1), (True, MUL, 1), (True, GATE_UP, 16), (True, GATE_UP, 32)]
)
def test_split_k_kernels_compile_for_hopper_without_a_gpu(int4, epilogue, block_m):
    """The split-K kernel and its reduction compiled to sm_90 cubins by Triton's bundled ptxas, with the
    divisibility a GPU launch gives its pointers and sizes (as ``test_quant_matmul``'s compile test)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from g4serve.kernels.quant_matmul import _quant_matmul_split, _split_reduce, int4_block_k, int4_swap

    target = GPUTarget("cuda", 90, 32)
    divisible = make_backend(target).parse_attr("D")

    def compile_(fn, signature, constexprs, warps, stages):
        names = list(fn.arg_names)
        attrs = {(names.index(a),): divisible for a, t in signature.items() if t.startswith("*")}
        src = ASTSource(fn, signature, {(names.index(c),): v for c, v in constexprs.items()}, attrs)
        try:
            return triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
        except (FileNotFoundError, PermissionError) as exc:  # no bundled ptxas on this machine
            pytest.skip(f"Triton cannot reach ptxas here: {exc}")

    ints = "M N K num_groups stride_xm stride_wn stride_sn stride_zn scale_bn scale_bk"
    signature = {"X": "*bf16", "W": "*i32" if int4 else "*fp8e4nv", "S": "*bf16" if int4 else "*fp32"}
    signature |= {"Z": "*i8", "P": "*fp32"} | {name: "i32" for name in ints.split()}
    block_n, block_k = (16, 512) if block_m == 1 else (32, int4_block_k(block_m) if int4 else 128)
    constexprs = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUPS=block_k // 128 if int4 else 1,
        INT4=int4,
        HAS_ZERO=int4,
        EPILOGUE=epilogue,
        USE_DOT=block_m > 1,
        UPCAST=False,
        DOT_PRECISION="tf32",
        USE_PDL=True,
        SWAP=int4 and block_m > 1 and int4_swap(block_m),  # the nibble planes with the operands swapped
        PLANES=int(int4 and block_m > 1),  # int4 row tiles: the planes on bf16x2 lanes (PTX)
    )
    assert compile_(_quant_matmul_split.compiled, signature, constexprs, 4, 1 if block_m == 1 else 3).asm[
        "cubin"
    ]
    signature = {"P": "*fp32", "E": "*bf16", "Y": "*bf16"}
    signature |= {name: "i32" for name in "M N splits stride_em stride_ym".split()}
    reduce = dict(BLOCK_N=1024, EPILOGUE=epilogue, ACT=0, USE_PDL=True)
    assert compile_(_split_reduce.compiled, signature, reduce, 4, 1).asm["cubin"]
