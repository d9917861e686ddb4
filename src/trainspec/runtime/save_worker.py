"""The background half of async checkpoint saves: one long-lived daemon thread, jobs in order."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class SaveWorker:
    """One daemon thread running the background halves of saves, in order.

    Started once: a thread started per save cost the loop up to a GIL switch interval (5 ms),
    because `Thread.start` waits for the new thread, which then runs on in Python holding the
    GIL. A daemon thread, unlike a ThreadPoolExecutor's worker, never holds up interpreter exit
    when a peer died and the commit barrier is waiting out its timeout.
    """

    def __init__(self) -> None:
        self._closed = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="trainspec-checkpoint-commit", daemon=True
        )
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue `fn(*args)`; RuntimeError after `close()` (nothing would ever run it)."""
        if self._closed:
            raise RuntimeError("the save worker is closed")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
