"""One headscope call on a model at a time: calls from several threads on one model take turns.

Each call switches the model's attention implementation and routes its modules to the call's capture for the length
of its block (headscope.model.capture.attached), so two at once would read each other's layers. A call from inside
another's block in the same thread (a callback) would wait on itself: it is refused in one line instead.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

from headscope.errors import ConfigError

# a model's decoder layers -> the lock an attached block holds: headscope calls on one model from several threads
# take turns (each switches the model's attention implementation and routes its modules for its block's length).
_TURNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TURNS_GUARD = threading.Lock()


@contextlib.contextmanager
def one_call_at_a_time(model: torch.nn.Module) -> Iterator[None]:
    """Wait while another thread's call uses `model` (any object the call holds: its decoder layers); refuse a call
    inside a call of the same thread."""
    with _TURNS_GUARD:
        lock, owner = _TURNS.setdefault(model, (threading.Lock(), [None]))  # owner: [the thread holding it]
    if owner[0] == threading.get_ident():
        raise ConfigError(
            "this model is already in use by a headscope call in this thread (a call from inside another's "
            "callback?): headscope runs one call on a model at a time"
        )
    with lock:
        owner[0] = threading.get_ident()
        try:
            yield
        finally:
            owner[0] = None
