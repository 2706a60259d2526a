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


def expected_attention(head: int, n: int, beta: float = BETA) -> np.ndarray:
    """The (n, n) attention layer 0's planted `head` gives any n-token sentence (planted with `beta`)."""
    attn = np.zeros((n, n))
    for t in range(n):
        if head == UNIFORM:
            attn[t, : t + 1] = 1.0 / (t + 1)
            continue
        target = t - 1 if head == PREVIOUS else 0
        if target < 0:  # row 0 of the previous-token head sees only itself
            attn[t, 0] = 1.0
            continue
        attn[t, : t + 1] = 1.0 / (math.exp(beta) + t)
        attn[t, target] = math.exp(beta) / (math.exp(beta) + t)
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


def build_planted_gpt2(
    folder: Path, corpus_lines: list[str], beta: float = BETA, *, silent: int | None = None, then_previous: float = 0.0
) -> Path:
    """Save the planted model (scores `beta` on the planted keys) and its tokenizer into `folder`; return it.

    silent: a layer-0 head whose value weights are zero (it attends as planted and writes nothing);
    then_previous: the first-token head also scores `then_previous * beta` on the previous token (off the sink, it
    is a previous-token head)."""
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
        a = beta * math.sqrt(HEAD_DIM) / c**2  # query scale giving score beta after GPT-2's 1/sqrt(head_dim)
        weight = torch.zeros(N_EMBD, 3 * N_EMBD)  # Conv1D: (in, q|k|v out)
        q, k = 0, N_EMBD
        for t in range(N_POSITIONS):
            for head in (PREVIOUS, FIRST):
                weight[t, k + head * HEAD_DIM + t] = 1.0  # key of position t: one-hot t
            if t >= 1:
                weight[t, q + PREVIOUS * HEAD_DIM + t - 1] = a  # query of t looks for key t-1
            weight[t, q + FIRST * HEAD_DIM + 0] = a  # query of t looks for key 0
            if t >= 2 and then_previous:
                weight[t, q + FIRST * HEAD_DIM + t - 1] = then_previous * a  # and, less, for key t-1
        weight[:, 2 * N_EMBD :] = block.attn.c_attn.weight[:, 2 * N_EMBD :]  # keep random values
        if silent is not None:
            weight[:, 2 * N_EMBD + silent * HEAD_DIM : 2 * N_EMBD + (silent + 1) * HEAD_DIM] = 0.0
        block.attn.c_attn.weight.copy_(weight)
        block.attn.c_attn.bias.zero_()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- an induction circuit

IND_VOCAB = 40  # [UNK], [PAD] and 38 ordinary words w2..w39: enough for probes of up to 38 tokens
IND_POSITIONS = 72
IND_HEADS = 4
CIRCUIT = 0  # the hand-set head in each layer; the others keep random weights and write nothing
IND_BETA = 10.0


def induction_words() -> list[str]:
    return [f"w{i}" for i in range(2, IND_VOCAB)]


def build_planted_induction(folder: Path, *, predicts: bool = False, sharpness: float = IND_BETA) -> Path:
    """A 2-layer GPT-2 holding an induction circuit, with a word-level tokenizer of IND_VOCAB tokens. predicts: an LM
    (GPT2LMHeadModel, its head tied to the embeddings) whose induction head also copies the token it attends to into
    the token code, so that the logits predict it: the circuit the loss reads. sharpness: the induction head's score on
    the key it looks for (IND_BETA: a weight of 1 to float precision; a few: soft attention, whose gradient EAP
    reads at the clean run).

    The residual stream has three zero-mean codes, each a +1/-1 pair of dimensions (so GPT-2's LayerNorm
    only rescales it): the token in T = [0, 2V), the previous token in PT = [2V, 4V) (empty until layer 0
    writes it), the position in P = [4V, 4V + 2N).
    - layer 0, head 0 (previous-token): the query of position t looks for the key of position t - 1 (score
      IND_BETA there, 0 elsewhere); the value is the key position's token; the output projection writes it
      into PT, so every position now carries the token before it.
    - layer 1, head 0 (induction): the query is the current token, the key is PT: a key matches when the
      token before it equals the current one, i.e. the key follows an earlier occurrence of the current token.
    The other heads keep GPT-2's random weights (near-uniform attention) and their outputs are discarded,
    as are the MLPs (zero weights).
    """
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    vocab, positions, dim = IND_VOCAB, IND_POSITIONS, 4 * IND_VOCAB + 2 * IND_POSITIONS
    head_dim = dim // IND_HEADS
    assert head_dim >= max(vocab, positions)
    tokenizer = build_tokenizer(induction_words())
    assert len(tokenizer) == vocab
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=dim,
        n_layer=2,
        n_head=IND_HEADS,
        n_inner=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(config) if predicts else None
    model = lm.transformer if predicts else GPT2Model(config)
    token, prev_token, position = 0, 2 * vocab, 4 * vocab  # where each code starts
    eps = config.layer_norm_epsilon
    c0 = 1.0 / math.sqrt(4.0 / dim + eps)  # LayerNorm's scale for token + position codes (norm^2 = 4)
    c1 = 1.0 / math.sqrt((4.0 + 2.0 * c0**2) / dim + eps)  # ... once layer 0 added the previous token
    q, k, v = 0, dim, 2 * dim  # offsets of the query, key and value blocks of c_attn's output
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wpe.weight.zero_()
        for t in range(vocab):
            model.wte.weight[t, token + t], model.wte.weight[t, token + vocab + t] = 1.0, -1.0
        for p in range(positions):
            model.wpe.weight[p, position + p], model.wpe.weight[p, position + positions + p] = 1.0, -1.0
        for block in model.h:
            for norm in (block.ln_1, block.ln_2):
                norm.weight.fill_(1.0)
                norm.bias.zero_()
            for weight in (block.mlp.c_fc.weight, block.mlp.c_fc.bias, block.mlp.c_proj.weight, block.mlp.c_proj.bias):
                weight.zero_()
            block.attn.c_attn.bias.zero_()
            block.attn.c_proj.weight.zero_()  # no head writes to the residual stream...
            block.attn.c_proj.bias.zero_()
            attn = block.attn.c_attn.weight  # Conv1D: (in, q|k|v out); head h owns columns h*head_dim...
            for block_start in (q, k, v):
                attn[:, block_start : block_start + head_dim] = 0.0
        # Layer 0, head 0: previous token. Score IND_BETA after GPT-2's 1/sqrt(head_dim) scaling.
        layer0 = model.h[0].attn
        a0 = IND_BETA * math.sqrt(head_dim) / c0**2
        for p in range(positions):
            layer0.c_attn.weight[position + p, k + p] = 1.0
            if p >= 1:
                layer0.c_attn.weight[position + p, q + p - 1] = a0
        for t in range(vocab):
            layer0.c_attn.weight[token + t, v + t] = 1.0  # value: the key position's token
            layer0.c_proj.weight[t, prev_token + t] = 1.0  # ...but this one: write it into PT
            layer0.c_proj.weight[t, prev_token + vocab + t] = -1.0
        # Layer 1, head 0: induction. Query: the current token; key: the previous-token code.
        layer1 = model.h[1].attn
        a1 = sharpness * math.sqrt(head_dim) / (c1**2 * c0)
        for t in range(vocab):
            layer1.c_attn.weight[token + t, q + t] = a1
            layer1.c_attn.weight[prev_token + t, k + t] = 1.0
            if predicts:  # value: the key position's token; written into the token code, which the head reads
                layer1.c_attn.weight[token + t, v + t] = 1.0
                layer1.c_proj.weight[t, token + t] = IND_BETA
                layer1.c_proj.weight[t, token + vocab + t] = -IND_BETA
    (lm if predicts else model).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- one head the loss depends on

COPY_VOCAB = 12  # [UNK], [PAD], w2..w11
COPY_POSITIONS = 24
COPY_HEADS = 4
COPY_BETA = 30.0  # the copying head's score on itself: its weight there is 1 - t e^-30, 1 to float precision
COPY_LOGIT = 4.0  # the logit the LM head gives the copied token (all others get 0)


def copy_words() -> list[str]:
    return [f"w{i}" for i in range(2, COPY_VOCAB)]


def copied_sentences(count: int) -> list[str]:
    """`count` sentences of one copy word repeated 3 to 8 times (the copier's loss is all in the repeats)."""
    words = copy_words()
    return [" ".join([words[i % 7]] * (3 + i % 6)) for i in range(count)]


def copy_scales(quiet: float = 1.0) -> tuple[float, float, int]:
    """(c0, alpha, dim): LayerNorm's scale of the token + position codes, the LM head's gain, the width; the copy
    code written `quiet` times as loud (the LM head's gain makes up for it)."""
    dim = 4 * COPY_VOCAB + 2 * COPY_POSITIONS
    c0 = 1.0 / math.sqrt(4.0 / dim + 1e-5)
    c_final = 1.0 / math.sqrt((4.0 + 2.0 * (quiet * c0) ** 2) / dim + 1e-5)  # with the copied code in the stream
    return c0, COPY_LOGIT / (2.0 * c_final * quiet * c0), dim


def build_planted_copier(
    folder: Path,
    copiers: tuple[int, ...] = (0,),
    logit: float = COPY_LOGIT,
    reads_from: int | None = None,
    quiet: float = 1.0,
) -> Path:
    """A 2-layer GPT-2 LM in which only head 0 of layer 0 carries what the next token needs.

    copiers, logit: the heads of layer 0 that copy (each writes the whole copy code: several are redundant
    copies of one another), and the logit the LM head gives the copied token when one of them writes it (the
    formulas below hold for one copier; with several the copy code is their sum).

    reads_from: the copying heads attend to this position from every later query (the first queries, which cannot
    see it yet, spread over what they see) instead of to their own position: the logits favour the token there.

    quiet: the copiers write the copy code this many times as loud (the LM head's gain makes up for it, so the
    logits stay): a quiet copier writes a small share of the residual stream and still carries the loss.

    Codes in the residual stream (each a +1/-1 pair, zero-mean): token T = [0, 2V), copy C = [2V, 4V),
    position P = [4V, 4V + 2N). Head (0, 0) attends to its own position (score COPY_BETA) and its output
    projection writes the token it reads into C; the untied LM head reads C alone, giving the copied token
    logit COPY_LOGIT and every other token 0. Every other head's output projection and every MLP are zero,
    so nothing else reaches the loss. On sentences that repeat one word, the next token is the current one:
      clean loss per predicted token  ln(1 + (V - 1) e^-COPY_LOGIT)
      head (0, 0) zero-ablated        ln V (every logit 0)
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, positions = COPY_VOCAB, COPY_POSITIONS
    c0, alpha, dim = copy_scales(quiet)
    alpha *= logit / COPY_LOGIT
    head_dim = dim // COPY_HEADS
    assert head_dim >= max(vocab, positions)
    tokenizer = build_tokenizer(copy_words())
    assert len(tokenizer) == vocab
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=dim,
        n_layer=2,
        n_head=COPY_HEADS,
        n_inner=4,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    copy, position = 2 * vocab, 4 * vocab
    q, k, v = 0, dim, 2 * dim
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.transformer.wpe.weight.zero_()
        for t in range(vocab):
            model.transformer.wte.weight[t, t], model.transformer.wte.weight[t, vocab + t] = 1.0, -1.0
        for p in range(positions):
            model.transformer.wpe.weight[p, position + p] = 1.0
            model.transformer.wpe.weight[p, position + positions + p] = -1.0
        for norm in (model.transformer.ln_f, *(n for block in model.transformer.h for n in (block.ln_1, block.ln_2))):
            norm.weight.fill_(1.0)
            norm.bias.zero_()
        for block in model.transformer.h:
            for weight in (block.mlp.c_fc.weight, block.mlp.c_fc.bias, block.mlp.c_proj.weight, block.mlp.c_proj.bias):
                weight.zero_()
            block.attn.c_attn.bias.zero_()
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
            block.attn.c_attn.weight[:, q : q + head_dim] = 0.0  # head 0 of each layer starts blank
            block.attn.c_attn.weight[:, k : k + head_dim] = 0.0
            block.attn.c_attn.weight[:, v : v + head_dim] = 0.0
        attn = model.transformer.h[0].attn
        a = COPY_BETA * math.sqrt(head_dim) / c0**2
        for head in copiers:
            offset = head * head_dim
            attn.c_attn.weight[:, q + offset : q + offset + head_dim] = 0.0
            attn.c_attn.weight[:, k + offset : k + offset + head_dim] = 0.0
            attn.c_attn.weight[:, v + offset : v + offset + head_dim] = 0.0
            for p in range(positions):
                looks_for = p if reads_from is None else reads_from
                attn.c_attn.weight[position + p, q + offset + looks_for] = a  # the query of position p looks for it
                attn.c_attn.weight[position + p, k + offset + p] = 1.0
            for t in range(vocab):
                attn.c_attn.weight[t, v + offset + t] = 1.0  # value: the token
                attn.c_proj.weight[offset + t, copy + t] = quiet  # written into C
                attn.c_proj.weight[offset + t, copy + vocab + t] = -quiet
        model.lm_head.weight.zero_()
        for t in range(vocab):
            model.lm_head.weight[t, copy + t] = alpha
            model.lm_head.weight[t, copy + vocab + t] = -alpha
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Pairs for the copier built with reads_from=1: the token at position 1 differs, the clean prompt's is the answer and
# the corrupt prompt's the distractor.
READER_PAIRS = (
    ("w2 w3 w5 w6 w7", "w2 w4 w5 w6 w7", "w3", "w4"),
    ("w9 w5 w2 w2 w8", "w9 w6 w2 w2 w8", "w5", "w6"),
    ("w7 w10 w11 w3 w3", "w7 w8 w11 w3 w3", "w10", "w8"),
)


def write_reader_pairs(path: Path, rows=READER_PAIRS) -> Path:
    """`rows` as a pairs file (.jsonl: one object per line)."""
    import json

    names = ("clean", "corrupt", "answer", "distractor")
    path.write_text("".join(json.dumps(dict(zip(names, row, strict=True))) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------- a post-attention norm (Gemma 2)

POST_HIDDEN, POST_HEADS, POST_HEAD_DIM = 64, 4, 16
POST_GAIN = 2.0  # layer 0's post-attention norm gain, (1 + w) in Gemma's norm
QUIET = 1e-3  # head 0's output-projection columns, scaled: before the norm it writes next to nothing
LOUD = 0  # that head; layer 0's other heads have zero value weights and write nothing at all


def build_planted_post_norm(folder: Path, corpus_lines: list[str], *, causal_lm: bool = False) -> Path:
    """A 2-layer Gemma 2 whose layer 0 has one head that writes (LOUD) and three that write nothing (zero value
    weights). LOUD's output-projection columns are scaled by QUIET, so before the post-attention norm it writes
    1e-3 of what a head usually does; after the norm (gain POST_GAIN, eps 1e-30) the layer adds
    POST_GAIN * o / rms(o), whose norm is POST_GAIN * sqrt(POST_HIDDEN) = 16 on every row: all of it LOUD's.
    causal_lm: save the LM (tied embeddings) for the loss, else the base model."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma2Model

    tokenizer = build_tokenizer([w for line in corpus_lines for w in line.split()])
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=POST_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=POST_HEADS,
        num_key_value_heads=POST_HEADS,
        head_dim=POST_HEAD_DIM,
        rms_norm_eps=1e-30,  # o is some 1e-5 here: any usual eps would be a share of its rms
        sliding_window=64,
        max_position_embeddings=128,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    model = (Gemma2ForCausalLM if causal_lm else Gemma2Model)(config)
    layer = (model.model if causal_lm else model).layers[0]
    with torch.no_grad():
        value = layer.self_attn.v_proj.weight  # (heads * head_dim, hidden)
        value[(LOUD + 1) * POST_HEAD_DIM :] = 0.0
        layer.self_attn.o_proj.weight[:, LOUD * POST_HEAD_DIM : (LOUD + 1) * POST_HEAD_DIM] *= QUIET
        layer.post_attention_layernorm.weight.fill_(POST_GAIN - 1.0)  # Gemma's norm multiplies by (1 + w)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
