"""``g4serve serve`` writes every thread's stack on SIGUSR1 and keeps running (how a hung server is read)."""

import os
import signal
import threading
import time

import pytest

from g4serve.server.launch import dump_stacks_on_sigusr1

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")


def test_sigusr1_dumps_every_thread_and_the_process_goes_on(capfd):
    stop = threading.Event()

    def engine_thread_waiting():
        stop.wait(10)

    worker = threading.Thread(target=engine_thread_waiting, name="engine")
    worker.start()
    try:
        dump_stacks_on_sigusr1()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        err = capfd.readouterr().err
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        stop.set()
        worker.join()
    assert "stacks of" in err and "Thread MainThread" in err  # the thread the handler runs in
    assert "Thread engine" in err and "engine_thread_waiting" in err  # and the others, by name and function
