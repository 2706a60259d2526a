"""The host side of a run: sentences -> token ids -> padded batches on the device.

`CorpusFeed` is the corpus as the model sees it: chunks of sentences, each tokenized once, that every pass
(statistics, importance, the example sentence) batches from. Tokenizing follows the model's own conventions
(tokenizer defaults, each sentence alone). Sentences of similar length are batched together to keep padding
(wasted compute) small; every metric is a sum over each sentence's own rows, so neither the grouping nor the
padding side changes any number.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from headscope.model.batch import Batch, batches_in_order
from headscope.run.corpus import Corpus, Sentence


def tokenize_sentences(
    tokenizer, texts: list[str], max_length: int | None, *, max_chars: int | None = None
) -> tuple[list[list[int]], list[bool]]:
    """Token ids of each text (add_special_tokens=True) and whether it was cut to `max_length`.

    Sentences are tokenized untruncated first, so we know which ones were cut; only
    those are tokenized again with truncation, letting the tokenizer keep any
    special tokens it appends. A text longer than `max_chars` is cut to that many characters first
    (`char_limit`: it would be cut to max_length tokens anyway), so a 100 MB line costs no more than a long one.
    """
    if max_chars is not None:
        texts = [text[:max_chars] for text in texts]
    ids = _token_ids(tokenizer, texts)
    truncated = [max_length is not None and len(row) > max_length for row in ids]
    for i, cut in enumerate(truncated):
        if cut:
            ids[i] = tokenizer(texts[i], add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
    return [list(row) for row in ids], truncated


def char_limit(tokenizer, max_length: int | None) -> int | None:
    """Characters a text may keep and still give the same first `max_length` tokens, with room to spare: no
    token covers more characters than the longest entry of the vocabulary, so a text longer than
    max_length x longest has more than max_length tokens, and its first ones lie well before the cut."""
    if max_length is None:
        return None
    return 2 * (max_length + 1) * max(_longest_token(tokenizer), 1)


# tokenizer -> (its size, its longest entry's characters): reading the vocabulary costs 0.05 s (SmolLM2), a tenth
# of analyzing one 128-token text; the size tells a tokenizer that gained tokens since.
_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _longest_token(tokenizer) -> int:
    size = len(tokenizer)
    try:
        known = _LONGEST.get(tokenizer)
    except TypeError:  # not weakly referable, or unhashable: read every time
        known = None
    if known is not None and known[0] == size:
        return known[1]
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    with contextlib.suppress(TypeError):
        _LONGEST[tokenizer] = (size, longest)
    return longest


def _token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """tokenizer(texts, add_special_tokens=True)["input_ids"], without its per-sentence Python overhead.

    For a Rust-backed tokenizer that does not override how it encodes, transformers' call is set-up (no
    truncation, no padding, special-token splitting) + the backend's encode_batch + a conversion of every
    encoding into Python dicts; the conversion costs more than the encoding itself and holds the GIL. One
    call on the first text does the same set-up, then the backend encodes the rest and only the ids are read.
    Any other tokenizer takes the plain call.
    """
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    plain = not isinstance(tokenizer, TokenizersBackend) or type(tokenizer)._encode_plus is not (
        TokenizersBackend._encode_plus
    )
    if plain or len(texts) < 2:
        return tokenizer(texts, add_special_tokens=True)["input_ids"]
    first = tokenizer(texts[:1], add_special_tokens=True)["input_ids"]  # the set-up, as transformers does it
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:  # set-up left them on: do not guess
        return tokenizer(texts, add_special_tokens=True)["input_ids"]
    # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never read: 15% faster, same ids.
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return first + [encoding.ids for encoding in encode(texts[1:], add_special_tokens=True)]


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token decoded alone, spaces kept (" the").

    A token holding only part of a character (byte-level BPE splits emoji and most CJK characters into
    several tokens) decodes alone to U+FFFD; it is written as its bytes instead, e.g. ``\\xf0\\x9f``.
    """
    distinct = list(dict.fromkeys(int(token_id) for token_id in ids))  # a long text repeats its tokens: each once
    decoded = dict(zip(distinct, tokenizer.batch_decode([[token_id] for token_id in distinct]), strict=True))
    for token_id, text in decoded.items():
        if "\ufffd" in text:
            decoded[token_id] = _piece_bytes(tokenizer.convert_ids_to_tokens(token_id))
    return [decoded[int(token_id)] for token_id in ids]


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Readable labels for chart axes: `token_texts` with surrounding spaces dropped (a token of spaces alone
    shows as its piece, quoted)."""
    labels = []
    for token_id, text in zip(ids, token_texts(tokenizer, ids), strict=True):
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


@dataclass
class Chunk:
    """One chunk of the corpus, tokenized: its sentences, their token ids and whether each was cut."""

    index: int
    sentences: list[Sentence]
    ids: list[list[int]]  # one list per sentence, empty for a sentence the tokenizer turned into nothing
    cut: list[bool]  # cut to the plan's max_length
    capped: int = 0  # sentences so long that their text was cut to the feed's max_chars before tokenizing

    @property
    def tokenized(self) -> dict[int, list[int]]:
        """sentence id -> token ids, for the sentences that have any."""
        return {s.sentence_id: row for s, row in zip(self.sentences, self.ids, strict=True) if row}


class CorpusFeed:
    """The corpus in chunks of `chunk_sentences` (the unit of host memory, checkpoints and data-parallel work),
    each tokenized once, and batches of them for any pass.

    keep: hold every tokenized chunk for later passes (head importance reads the corpus again); otherwise a
    chunk is tokenized when asked for and dropped by the caller.
    """

    def __init__(self, corpus: Corpus, tokenizer, *, max_length: int | None, chunk_sentences: int, keep: bool) -> None:
        self.corpus, self.tokenizer = corpus, tokenizer
        self.max_length, self.chunk_sentences, self.keep = max_length, chunk_sentences, keep
        self.max_chars = char_limit(tokenizer, max_length)
        self._kept: dict[int, Chunk] = {}

    def __len__(self) -> int:
        return -(-len(self.corpus.sentences) // self.chunk_sentences)

    def sentences(self, index: int) -> list[Sentence]:
        first = index * self.chunk_sentences
        return self.corpus.sentences[first : first + self.chunk_sentences]

    def chunk(self, index: int) -> Chunk:
        if index in self._kept:
            return self._kept[index]
        sentences = self.sentences(index)
        texts = [s.text for s in sentences]
        ids, cut = tokenize_sentences(self.tokenizer, texts, self.max_length, max_chars=self.max_chars)
        capped = 0 if self.max_chars is None else sum(len(text) > self.max_chars for text in texts)
        chunk = Chunk(index, sentences, ids, cut, capped)
        if self.keep:
            self._kept[index] = chunk
        return chunk

    def batches(self, chunk: Chunk, *, max_sentences: int, max_tokens: int, padding_side: str) -> Iterator[Batch]:
        """The chunk's sentences with tokens, collated into batches planned by length (on the host)."""
        yield from batches_in_order(
            chunk.tokenized, max_sentences=max_sentences, max_tokens=max_tokens, padding_side=padding_side
        )

    def token_ids(self, sentence_id: int, max_length: int | None) -> tuple[list[int], bool]:
        """One sentence's ids, cut to `max_length` (and the feed's own) as the corpus pass cuts them, and whether
        they were cut."""
        limits = [x for x in (max_length, self.max_length) if x is not None]
        text = self.corpus.sentences[sentence_id].text
        ids, cut = tokenize_sentences(self.tokenizer, [text], min(limits) if limits else None, max_chars=self.max_chars)
        return ids[0], cut[0]
