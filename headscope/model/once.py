"""One model load at a time in this process, and within it each file parsed once.

transformers' loading is not thread-safe: threads loading models at once all failed, and left the process broken.
And it parses a GGUF file three times for one model (its config, its tokenizer, its weights: 3.4 s each for
SmolLM2's small file, a minute each on a large one). `one_load()` serialises loads (re-entrant: a command's load
spans its config, its tokenizer checks and its weights) and, for its length, hands transformers the same GGUF reader
(a read-only memory map of the file) for the same file, and `read_once` the same tokenizer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_LOADING = threading.RLock()
_WITHIN: dict = {"depth": 0, "readers": {}, "read": {}}  # what the load in progress parsed
QUIET = {"bars": False}  # set by a notebook's reporter: no third-party progress bar floods the cell that loads


@contextlib.contextmanager
def one_load() -> Iterator[None]:
    """The block is the only model load in progress; each GGUF file parsed once in it."""
    with _LOADING:
        _WITHIN["depth"] += 1
        try:
            with _gguf_parsed_once(), _bars_quiet() if QUIET["bars"] else contextlib.nullcontext():
                yield
        finally:
            _WITHIN["depth"] -= 1
            if _WITHIN["depth"] == 0:
                _WITHIN["readers"].clear()
                _WITHIN["read"].clear()


def read_once(key, read: Callable[[], object]):
    """read(), once per load (`one_load`) for each key."""
    with one_load():
        if key not in _WITHIN["read"]:
            _WITHIN["read"][key] = read()
        return _WITHIN["read"][key]


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers imports gguf.GGUFReader where it parses a file, and gguf.get_tensor_name_map where it names a
    GGUF file's tensors: for the load, the same file gives the same reader, and the same architecture the same map.
    transformers builds that map once per module of the model (395 times for SmolLM2, 33 ms each: 13 s of a 30 s
    load on two cores); it only reads it."""
    try:
        import gguf
    except ImportError:  # no GGUF support installed: nothing to parse
        yield
        return
    real, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    if getattr(real, "headscope_cached", False):  # an outer load put the cache in place
        yield
        return

    def cached(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in _WITHIN["readers"]:
            _WITHIN["readers"][key] = real(path, *args, **kwargs)
        return _WITHIN["readers"][key]

    def cached_map(arch, n_blocks):
        key = ("tensor names", arch, n_blocks)
        if key not in _WITHIN["read"]:
            _WITHIN["read"][key] = real_map(arch, n_blocks)
        return _WITHIN["read"][key]

    cached.headscope_cached = True
    gguf.GGUFReader, gguf.get_tensor_name_map = cached, cached_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real, real_map


@contextlib.contextmanager
def _bars_quiet() -> Iterator[None]:
    """No progress bar of transformers' own while a model loads: its GGUF de-quantizer's tqdm.auto bar (which, in a
    notebook without ipywidgets, also warns with a TqdmWarning per bar) and its download and weight-loading bars."""
    import warnings

    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        import tqdm
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no GGUF support: only transformers' own bars to hide
        gguf_utils = None
    real = getattr(gguf_utils, "tqdm", None)
    if real is not None:
        gguf_utils.tqdm = lambda *args, **kwargs: tqdm.tqdm(*args, **{**kwargs, "disable": True})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*IProgress not found.*")
            yield
    finally:
        if real is not None:
            gguf_utils.tqdm = real
        if shown:
            hf_logging.enable_progress_bar()
