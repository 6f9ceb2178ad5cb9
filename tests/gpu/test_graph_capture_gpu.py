"""CUDA graph capture beside other threads using the device: the server's media threads (``--media-on-gpu``)
copy and compute on their own streams while the engine thread captures an encoder graph for a shape first
seen under load. Under the default "global" capture mode their pageable copies invalidated the capture (32
audio QPS on an H200: the step failed and the media request got a 500); ``_capture`` captures in
"thread_local" mode."""

from __future__ import annotations

import threading

import pytest
import torch

from g4serve.engine.cuda_graphs import _capture

pytestmark = pytest.mark.gpu


def test_a_capture_survives_media_threads_copying_and_computing():
    device = torch.device("cuda")
    stop, errors, rounds = threading.Event(), [], [0]

    def media_thread():
        with torch.cuda.stream(torch.cuda.Stream(device)):
            while not stop.is_set():
                try:
                    x = torch.randn(256, 256).to(device)  # a pageable copy, as the log-mel's waves are
                    (x @ x).sum().item()  # and a read-back, as the content hash is
                    rounds[0] += 1
                except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                    errors.append(exc)
                    return

    layers = [torch.nn.Linear(512, 512, device=device) for _ in range(16)]
    x = torch.randn(64, 512, device=device)

    def forward():
        h = x
        for layer in layers:
            h = torch.nn.functional.gelu(layer(h))
        return h

    threads = [threading.Thread(target=media_thread) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        pool = torch.cuda.graph_pool_handle()
        for _ in range(30):
            graph, out = _capture(forward, pool, device)
            graph.replay()
            torch.testing.assert_close(out, forward())
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert rounds[0] > 0
