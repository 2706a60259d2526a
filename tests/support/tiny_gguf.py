"""A tiny Llama in a GGUF file, written with gguf's own writer: a real GGUF file that transformers parses, converts
and de-quantizes as it does any other, in a fraction of a second (SmolLM2's takes 21 s). Its weights are random
float32 (GGML's F32 type), its tokenizer a byte-level BPE of the 256 bytes and a few merges."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 16, 4, 2, 32
MERGES = ["t h", "th e", "Ġ t", "Ġt h", "Ġth e", "a n"]


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map, in byte order: each byte's printable stand-in."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(code) for _, code in sorted(zip(printable, codes, strict=True))]


def write_tiny_gguf(path: Path, *, seed: int = 0, untied: bool = True) -> Path:
    """Write the tiny Llama to `path` (a .gguf file) and return it."""
    import gguf

    tokens = ["<|endoftext|>", *byte_symbols(), *("".join(merge.split()) for merge in MERGES)]
    rng = np.random.default_rng(seed)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, rng.normal(0.0, 0.3, size=shape).astype(np.float32))

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", len(tokens), HIDDEN)
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{layer}.attn_q.weight", HEADS * head_dim, HIDDEN)
        tensor(f"blk.{layer}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{layer}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{layer}.attn_output.weight", HIDDEN, HEADS * head_dim)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{layer}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{layer}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{layer}.ffn_down.weight", HIDDEN, FFN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if untied:
        tensor("output.weight", len(tokens), HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
