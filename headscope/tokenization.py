"""Turn sentences into token ids the way the model expects: tokenizer defaults, each sentence alone."""

from __future__ import annotations


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
    """Readable labels for chart axes: each token decoded alone, surrounding spaces dropped."""
    labels = []
    for token_id in ids:
        text = tokenizer.decode([token_id]).strip()
        labels.append(text if text else repr(tokenizer.convert_ids_to_tokens(token_id)))
    return labels
