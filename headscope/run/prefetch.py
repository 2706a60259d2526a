"""Run a producer a few items ahead in a background thread, so that host work overlaps the model.

The corpus's host work (tokenizing, planning and collating batches, pinning them) runs in a thread while the
main thread runs the model: Hugging Face's Rust tokenizers, numpy and torch release the GIL in their heavy
parts, so the two really overlap. The queue is bounded, so the producer never runs more than `depth` items
ahead (host memory stays bounded), and an exception in the producer is raised in the consumer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


def prefetched(items: Iterable[T], depth: int = 4) -> Iterator[T]:
    """Iterate `items` (produced in a background thread, at most `depth` ahead) in order.

    Stopping early (break, an exception in the consumer, the generator closed) stops the producer at its
    next item; an exception in the producer is re-raised here, after the items before it.
    """
    if depth < 1:
        yield from items
        return
    handoff: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
        except BaseException as err:  # handed to the consumer, which raises it
            put((_DONE, err))
            return
        put((_DONE, None))

    thread = threading.Thread(target=produce, name="headscope-host", daemon=True)
    thread.start()
    try:
        while True:
            item, error = handoff.get()
            if item is _DONE:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        thread.join()
