"""A 2-layer GPT-2 whose layer 0 holds three heads with known attention.

Token embeddings are zero and position t is embedded as e_t - e_(64+t), which
has zero mean and constant norm, so GPT-2's LayerNorm only rescales it by a
constant c. Query and key weights then give exact scores:
    head 0 (uniform)        score 0 everywhere        -> A[t,s] = 1/(t+1)
    head 1 (previous token) score BETA at s = t-1     -> A[t,t-1] = e^B/(e^B+t)
    head 2 (first token)    score BETA at s = 0       -> A[t,0]   = e^B/(e^B+t)
Layer 1 keeps random weights. The tokenizer is word-level, built offline.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

BETA = 8.0
N_POSITIONS = 64
N_EMBD = 192
N_HEAD = 3
HEAD_DIM = N_EMBD // N_HEAD
UNIFORM, PREVIOUS, FIRST = 0, 1, 2


def expected_attention(head: int, n: int) -> np.ndarray:
    """The (n, n) attention layer 0's planted `head` gives any n-token sentence."""
    attn = np.zeros((n, n))
    for t in range(n):
        if head == UNIFORM:
            attn[t, : t + 1] = 1.0 / (t + 1)
            continue
        target = t - 1 if head == PREVIOUS else 0
        if target < 0:  # row 0 of the previous-token head sees only itself
            attn[t, 0] = 1.0
            continue
        attn[t, : t + 1] = 1.0 / (math.exp(BETA) + t)
        attn[t, target] = math.exp(BETA) / (math.exp(BETA) + t)
    return attn


def build_tokenizer(words: list[str]):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1}
    for word in words:
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")


def build_planted_gpt2(folder: Path, corpus_lines: list[str]) -> Path:
    """Save the planted model and its tokenizer into `folder`; return it."""
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import GPT2Config, GPT2Model

    words = [w for line in corpus_lines for w, _ in Whitespace().pre_tokenize_str(line)]
    tokenizer = build_tokenizer(words)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=N_POSITIONS,
        n_embd=N_EMBD,
        n_layer=2,
        n_head=N_HEAD,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2Model(config)
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wpe.weight.zero_()
        for t in range(N_POSITIONS):
            model.wpe.weight[t, t] = 1.0
            model.wpe.weight[t, N_POSITIONS + t] = -1.0
        block = model.h[0]
        block.ln_1.weight.fill_(1.0)
        block.ln_1.bias.zero_()
        c = 1.0 / math.sqrt(2.0 / N_EMBD + config.layer_norm_epsilon)  # LayerNorm's rescaling of e_t - e_(64+t)
        a = BETA * math.sqrt(HEAD_DIM) / c**2  # query scale giving score BETA after GPT-2's 1/sqrt(head_dim)
        weight = torch.zeros(N_EMBD, 3 * N_EMBD)  # Conv1D: (in, q|k|v out)
        q, k = 0, N_EMBD
        for t in range(N_POSITIONS):
            for head in (PREVIOUS, FIRST):
                weight[t, k + head * HEAD_DIM + t] = 1.0  # key of position t: one-hot t
            if t >= 1:
                weight[t, q + PREVIOUS * HEAD_DIM + t - 1] = a  # query of t looks for key t-1
            weight[t, q + FIRST * HEAD_DIM + 0] = a  # query of t looks for key 0
        weight[:, 2 * N_EMBD :] = block.attn.c_attn.weight[:, 2 * N_EMBD :]  # keep random values
        block.attn.c_attn.weight.copy_(weight)
        block.attn.c_attn.bias.zero_()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
