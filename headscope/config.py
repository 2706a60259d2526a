"""Run settings: one frozen dataclass, every field documented."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from headscope.errors import ConfigError

Device = Literal["auto", "cuda", "cpu", "mps"]
DType = Literal["auto", "float32", "bfloat16", "float16"]

DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu", "mps")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RunConfig:
    """Everything `analyze` needs besides the model and the corpus."""

    revision: str | None = None  # hub branch, tag or commit; None = the repo's default branch
    trust_remote_code: bool = False  # allow a hub repo's own modelling code to run
    device: Device = "auto"  # auto: cuda if available, else mps, else cpu
    dtype: DType = "auto"  # auto: bfloat16 (float16 without bf16 support) on cuda, float16 on mps, float32 on cpu
    text_column: str = "text"  # column holding the sentence in .jsonl / .csv / .parquet corpora
    max_length: int | None = None  # truncate each sentence to this many tokens; None = the model's limit
    window: int = 2  # diagonal metric: mass within +-window positions of the query
    batch_size: int = 16  # sentences per forward pass (similar lengths are batched together)
    sentence_heads: bool = True  # also write per-(sentence, layer, head) metrics
    chunk_sentences: int = 4096  # sentences tokenized and length-sorted together; bounds host memory

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.window < 0:
            raise ConfigError(f"--window must be 0 or more; got {self.window}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be 1 or more; got {self.batch_size}")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"--max-length must be 1 or more; got {self.max_length}")
        if self.chunk_sentences < 1:
            raise ConfigError(f"chunk_sentences must be 1 or more; got {self.chunk_sentences}")

    def to_dict(self) -> dict:
        return {key: str(value) if isinstance(value, Path) else value for key, value in asdict(self).items()}


@dataclass(frozen=True)
class Thresholds:
    """Head-type rule, checked in this order: local, copy, broad, else mixed.

    locality = (diagonal - diagonal_uniform) / (1 - diagonal_uniform): the share of the mass that uniform
    attention would put outside the +-window band which the head keeps inside it (1 = all of it, 0 = no
    more than uniform). Judging against the uniform baseline matters: on a 6-token sentence uniform
    attention already has most of its mass within +-2 positions. norm_entropy is entropy / ln(visible keys),
    so neither test drifts with sentence length.
    """

    # local: at least this locality. A previous-token head scores ~1, a uniform head 0.
    local_min_locality: float = 0.5
    # copy: norm_entropy at most this; rows whose entropy is under 30% of uniform's hold most of their
    # mass on one or two keys.
    copy_max_norm_entropy: float = 0.3
    # broad: norm_entropy at least this; rows within 30% of uniform spread their mass widely.
    broad_min_norm_entropy: float = 0.7

    def __post_init__(self) -> None:
        if not -1.0 <= self.local_min_locality <= 1.0:
            raise ConfigError(f"--local-min-locality must be between -1 and 1; got {self.local_min_locality}")
        for name in ("copy_max_norm_entropy", "broad_min_norm_entropy"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be between 0 and 1; got {value}")
        if self.copy_max_norm_entropy >= self.broad_min_norm_entropy:
            raise ConfigError(
                f"--copy-max-norm-entropy ({self.copy_max_norm_entropy}) must be below "
                f"--broad-min-norm-entropy ({self.broad_min_norm_entropy})"
            )

    def to_dict(self) -> dict:
        return asdict(self)
