"""What a model's config says of its shape: layers, heads, KV heads, head size, each layer's kind of attention and
the longest sequence its positions allow (multimodal configs: their text model's)."""

from __future__ import annotations


def architecture_of(model_config) -> dict:
    text = text_config(model_config)
    heads = text.num_attention_heads
    return {
        "model_type": model_config.model_type,
        "layers": text.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
    }


def layer_attention(model_config) -> tuple[tuple[str, int | None], ...]:
    """Each layer's attention, as its config declares it: ("full", None), ("sliding", window) or ("chunked", chunk),
    or the config's own name for another kind. From `layer_types` where the config has them (Gemma 2 and 3, Qwen2,
    gpt-oss, ...); else a `sliding_window` on every layer (Mistral), unless `use_sliding_window` is False."""
    text = text_config(model_config)
    depth = text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types:
        kinds = []
        for kind in types:
            if "sliding" in kind:
                kinds.append(("sliding", window))
            elif "chunked" in kind:
                kinds.append(("chunked", getattr(text, "attention_chunk_size", None)))
            else:
                kinds.append(("full", None) if kind == "full_attention" else (kind, None))
        return tuple(kinds)
    if isinstance(window, int) and window > 0 and getattr(text, "use_sliding_window", True) is not False:
        return (("sliding", window),) * depth
    return (("full", None),) * depth


def model_max_length(model_config) -> int | None:
    """The longest sequence the model's position scheme supports, when the config says."""
    text = text_config(model_config)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def text_config(model_config):
    """The config of the text model (a multimodal config holds one), else the config itself."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
