"""The report's example views: every head's attention on a few short corpus sentences, spread over the corpus's
lengths, and on one probe sequence (repeated random tokens), where induction, duplicate-token and previous-token
heads show their stripes. Each is kept whole (`HeadAttention`), small by design.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from headscope.measures.heads import HeadAttention
from headscope.measures.probes import ProbeSpec, probe_sequences
from headscope.run.feed import CorpusFeed, token_labels
from headscope.tables import examples_frame

# An example is cut to at most this many tokens: it keeps every head's (t, t) attention, which must stay small
# even when every sentence of the corpus is thousands of tokens long.
EXAMPLE_MAX_TOKENS = 32
PROBE_EXAMPLE_LENGTH = 32  # random tokens per copy in the probe view, at most (two copies: the stripes show)


def choose_examples(lengths: dict[str, list[int]], count: int) -> list[int]:
    """Sentence ids of up to `count` examples spread over the corpus's lengths.

    lengths: token count -> [sentences of that length, the first one's id] (corpus_pass keeps it). The chosen
    lengths sit at the quantiles (k + 0.5) / count of the sentences of 2 to EXAMPLE_MAX_TOKENS tokens (of every
    sentence with tokens when none is that short); each example is the first sentence of its length.
    """
    table = sorted((int(length), counted, first) for length, (counted, first) in lengths.items() if int(length) > 0)
    usable = [row for row in table if 2 <= row[0] <= EXAMPLE_MAX_TOKENS] or table
    cumulative = np.cumsum([counted for _, counted, _ in usable])
    chosen = []
    for k in range(count if usable else 0):
        row = usable[int(np.searchsorted(cumulative, (k + 0.5) / count * cumulative[-1]))]
        if row[2] not in chosen:
            chosen.append(row[2])
    return chosen


def example_views(capture, feed: CorpusFeed, plan, lengths: dict[str, list[int]], *, device) -> pd.DataFrame:
    """Every head's attention on the chosen corpus sentences (source "corpus") and, with the probes, on one
    probe sequence (source "probe", sentence_id = its seed, 0), long-form (tables.EXAMPLES_SCHEMA)."""
    settings = plan.settings
    frames = []
    for sentence_id in choose_examples(lengths, settings.examples):
        ids, _ = feed.token_ids(sentence_id, EXAMPLE_MAX_TOKENS)
        frames.append(_view(capture, plan, "corpus", sentence_id, ids, feed.tokenizer, device))
    if settings.probes and settings.examples:
        spec = ProbeSpec(seeds=2, length=min(settings.probe_length, PROBE_EXAMPLE_LENGTH))
        sequence, _ = probe_sequences(feed.tokenizer, spec)
        frames.append(_view(capture, plan, "probe", 0, sequence(0), feed.tokenizer, device))
    return pd.concat(frames, ignore_index=True) if frames else examples_frame("corpus", 0, [], {}, {})


def _view(capture, plan, source: str, sentence_id: int, ids: list[int], tokenizer, device):
    batch = plan.collate([sentence_id], [ids], device)
    keeper = HeadAttention()
    capture.run(batch, measures=[keeper])
    return examples_frame(source, sentence_id, token_labels(tokenizer, ids), *keeper.finish())
