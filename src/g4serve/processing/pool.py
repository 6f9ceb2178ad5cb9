"""One process-wide thread pool for the CPU-heavy pieces of media preprocessing.

Image decoding (PIL), the antialiased resize (torch's uint8 kernel runs an image on one thread) and the
HWC copies release the GIL, so a video's frames can be processed side by side. Tasks in this pool never
wait on the pool themselves, so callers (the server's preprocessing workers, ``LLM``) can wait on it
without deadlocking.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


@functools.cache
def media_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="g4serve-media")


def map_in_pool(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[fn(x) for x in items]``, in the media pool when there are at least two and more than one CPU; the
    first failure in order is raised."""
    if len(items) < 2 or (os.cpu_count() or 1) < 2:
        return [fn(x) for x in items]
    futures = [media_pool().submit(fn, x) for x in items]
    return [f.result() for f in futures]
