"""``g4serve serve`` writes every thread's stack on SIGUSR1 and keeps running (how a hung server is read)."""

import faulthandler
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
        faulthandler.unregister(signal.SIGUSR1)
        stop.set()
        worker.join()
    assert "Current thread 0x" in err  # the thread the signal landed on
    assert "engine_thread_waiting" in err  # and the other threads, by function
