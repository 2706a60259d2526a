"""Turn sentences into token ids the way the model expects: tokenizer defaults, each sentence alone."""

from __future__ import annotations

import re


def model_max_length(config) -> int | None:
    """The longest sequence the model's position scheme supports, when the config says."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def tokenize_sentences(tokenizer, texts: list[str], max_length: int | None) -> tuple[list[list[int]], list[bool]]:
    """Token ids of each text (add_special_tokens=True) and whether it was cut to `max_length`.

    Sentences are tokenized untruncated first, so we know which ones were cut; only
    those are tokenized again with truncation, letting the tokenizer keep any
    special tokens it appends.
    """
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    truncated = [max_length is not None and len(row) > max_length for row in ids]
    for i, cut in enumerate(truncated):
        if cut:
            ids[i] = tokenizer(texts[i], add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
    return [list(row) for row in ids], truncated


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Readable labels for chart axes: each token decoded alone, surrounding spaces dropped.

    A token holding only part of a character (byte-level BPE splits emoji and most CJK characters into
    several tokens) decodes alone to U+FFFD; it is labelled with its bytes instead, e.g. ``\\xf0\\x9f``.
    """
    labels = []
    for token_id in ids:
        text = tokenizer.decode([token_id])
        if "\ufffd" in text:
            text = _piece_bytes(tokenizer.convert_ids_to_tokens(token_id))
        text = text.strip()
        labels.append(text if text else repr(tokenizer.convert_ids_to_tokens(token_id)))
    return labels


def _piece_bytes(piece: str) -> str:
    """A token piece as the bytes it stands for, undecodable ones written as \\xNN escapes."""
    byte_fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # SentencePiece's byte tokens
    if byte_fallback:
        return f"\\x{byte_fallback.group(1).lower()}"
    if all(char in _BYTE_OF_CHAR for char in piece):  # GPT-2-style byte-level pieces
        return bytes(_BYTE_OF_CHAR[char] for char in piece).decode("utf-8", errors="backslashreplace")
    return piece


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: the printable bytes stand for themselves and
    the others are shifted to 256 upwards (the same table every byte-level BPE tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in chars)
    chars.update({byte: chr(256 + n) for n, byte in enumerate(shifted)})
    return {char: byte for byte, char in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()
