"""bench/trace_summary.py: a Chrome trace's host events nested by time, inclusive time counted once through
recursion, self time net of callees, kernel and graph launches counted, ``--focus`` narrowing to what ran
inside a function, and the Markdown and JSON it writes."""

from __future__ import annotations

import gzip
import json

from bench_scripts import load_script

ts = load_script("trace_summary")


def _x(name, cat, t, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": t, "dur": dur, "pid": 7, "tid": tid}


def _trace():
    return {
        "traceEvents": [
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "engine"}},
            _x("engine.py(1): step", "python_function", 0, 1000),
            _x("engine.py(2): _launch", "python_function", 100, 600),
            _x("engine.py(3): walk", "python_function", 150, 300),
            _x("engine.py(3): walk", "python_function", 200, 100),  # recursion: counted once inclusive
            _x("aten::copy_", "cpu_op", 210, 50),
            _x("cudaLaunchKernel", "cuda_runtime", 500, 20),
            _x("cudaGraphLaunch", "cuda_runtime", 600, 40),
            _x("engine.py(4): _complete", "python_function", 750, 200),
            _x("cudaStreamSynchronize", "cuda_runtime", 760, 150),
            _x("loop.py(9): run", "python_function", 0, 400, tid=2),
            _x("step_kernel", "kernel", 0, 400, tid=3) | {"args": {"stream": 7}},  # device time
            _x("step_kernel", "kernel", 500, 400, tid=3) | {"args": {"stream": 7}},
            _x("encode_kernel", "kernel", 300, 300, tid=4) | {"args": {"stream": 9}},
        ]
    }


def test_nesting_inclusive_self_and_launches():
    engine, loop = ts.summarize(_trace(), min_busy_ms=0)
    assert engine.name == "engine" and loop.name == "tid 2"
    assert engine.busy_us == 1000 and loop.busy_us == 400
    assert engine.inclusive["engine.py(3): walk"] == 300 and engine.calls["engine.py(3): walk"] == 2
    assert engine.self_us[("python_function", "engine.py(3): walk")] == (300 - 100) + (100 - 50)
    assert engine.self_us[("python_function", "engine.py(2): _launch")] == 600 - 300 - 20 - 40
    assert engine.self_us[("python_function", "engine.py(1): step")] == 1000 - 600 - 200
    assert engine.self_us[("cuda_runtime", "cudaStreamSynchronize")] == 150
    assert (engine.kernel_launches, engine.graph_launches) == (1, 1)
    # the host sync, by the two innermost Python functions around it
    assert dict(engine.syncs) == {
        "cudaStreamSynchronize < engine.py(4): _complete < engine.py(1): step": [1, 150]
    }


def test_focus_narrows_to_what_ran_inside():
    (engine,) = ts.summarize(_trace(), focus="_launch", min_busy_ms=0)
    assert engine.busy_us == 600
    assert "engine.py(1): step" not in engine.inclusive and "engine.py(4): _complete" not in engine.inclusive
    assert (engine.kernel_launches, engine.graph_launches) == (1, 1)
    assert ts.summarize(_trace(), focus="_launch", min_busy_ms=0.7) == []  # busy below the floor


def test_device_work_by_stream():
    streams = ts.device_streams(_trace())
    assert list(streams) == ["7", "9"]  # the busiest first
    assert streams["7"] == {"launches": 2, "busy_ms": 0.8, "beside_busiest_ms": None}
    # the encode ran 300-600 us: beside the steps' kernels 300-400 and 500-600
    assert streams["9"] == {"launches": 1, "busy_ms": 0.3, "beside_busiest_ms": 0.2}
    assert ts._union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]


def test_main_writes_markdown_and_json(tmp_path, capsys):
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    ts.main([str(path), "--top", "3", "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert "## engine: 1.0 ms in traced calls; 1 kernel launches, 1 graph launches" in out
    assert "| 0.6 | 60.0% | 1 | `engine.py(2): _launch` |" in out
    assert "| 9 | 1 | 0.3 | 0.2 |" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["streams"]["9"]["beside_busiest_ms"] == 0.2
    summary = summary["threads"]
    assert summary[0]["thread"] == "engine" and summary[0]["inclusive_ms"][0] == ["engine.py(1): step", 1.0]
    assert "**host syncs, by the Python functions they came from**" in out
    assert (
        "| 0.1 | 15.0% | 1 | `cudaStreamSynchronize < engine.py(4): _complete < engine.py(1): step` |" in out
    )
    assert summary[0]["syncs"] == {
        "cudaStreamSynchronize < engine.py(4): _complete < engine.py(1): step": {"calls": 1, "ms": 0.15}
    }


def test_kernel_chain_charges_each_kernel_what_it_adds_to_the_stream():
    """Under dependent launch a kernel starts before the one ahead of it ends: the chain charges it only
    from that end on, so the shares add up to the busiest stream's busy time (a gap is nobody's)."""
    k = {"args": {"stream": 7}}
    trace = {
        "traceEvents": [
            _x("gemm", "kernel", 0, 100, tid=3) | k,
            _x("norm", "kernel", 60, 50, tid=3) | k,  # waited 40 us on the GEMM: adds 10
            _x("gemm", "kernel", 105, 100, tid=3) | k,  # starts before the norm ends: adds 95
            _x("norm", "kernel", 300, 10, tid=3) | k,  # after a 95 us gap: adds 10
            _x("encode", "kernel", 0, 400, tid=4) | {"args": {"stream": 9}},  # another, busier stream
            _x("encode", "kernel", 400, 10, tid=4) | {"args": {"stream": 9}},
        ]
    }
    assert ts.kernel_chain(trace) == {"encode": {"launches": 2, "chain_us": 410.0, "own_us": 410.0}}
    trace["traceEvents"] = trace["traceEvents"][:4]
    chain = ts.kernel_chain(trace)
    assert list(chain) == ["gemm", "norm"]
    assert chain["gemm"] == {"launches": 2, "chain_us": 195.0, "own_us": 200.0}
    assert chain["norm"] == {"launches": 2, "chain_us": 20.0, "own_us": 60.0}
    text = ts.render_chain(chain, 2, 5)
    assert (
        "0.107 ms a step" in text
        and "| gemm | 1 | 97.5 | 100.0 |" in text
        and "| norm | 1 | 10.0 | 30.0 |" in text
    )
    assert ts.kernel_chain({"traceEvents": []}) == {}
