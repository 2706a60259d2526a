"""headscope's C++ kernel on CPU (kernels/row_state.cpp), built on first use.

`row_state` does what the tile loop of attention.tile_loop does (the row statistics, and the attention output when
the values are given), with the q k^T and p v products and the reductions in one cache-resident loop, as sdpa's CPU
kernel does for the output alone (benchmarks/README.md); `weight_rows` what headscope.measures.row_sums's
weight_row_values does with the probabilities of the eager path, in one pass over each row; `row_sums` and
`write_sums` the per-(sentence, head) sums of those rows and of what the heads wrote (measures.row_sums,
measures.writes). It is built with torch's extension builder (a C++ compiler and ninja; about 45 s, once per machine
and source, kept in torch's extensions folder) and reads float32 (half precision read as float32). When it cannot be
built, or its first result disagrees with the plain computation, headscope keeps today's paths
(headscope.model.attention.dispatch).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from headscope.model.attention.finish_rows import RowValues
from headscope.model.attention.key_patterns import KeyPatterns, PatternRows
from headscope.model.masks import visible_keys

_log = logging.getLogger(__name__)
SOURCE = Path(__file__).resolve().parent / "kernels" / "row_state.cpp"

# Compiler flags per instruction set torch's own CPU kernels dispatch to (ATen/cpu/vec picks its Vectorized<float>
# from the CPU_CAPABILITY_* macro), so the build never needs more than the machine it runs on; the module's name
# carries the set, so a shared home folder never hands a build to a CPU lacking it. Any other set torch reports
# (aarch64's DEFAULT or SVE256, VSX, ...) builds with the compiler's defaults: the generic (or NEON) vectors.
ISA_FLAGS = {
    "DEFAULT": [],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-DCPU_CAPABILITY_AVX512"],
}
# The x86 sets in the order a CPU supports them: a CPU that runs one runs those before it.
X86_ISAS = ("DEFAULT", "AVX2", "AVX512")
CFLAGS = ["-O3", "-fopenmp"]


def host_isa() -> str:
    """The instruction set torch dispatches its own CPU kernels to on this machine."""
    return torch.backends.cpu.get_cpu_capability()


def one_line(err: Exception) -> str:
    """An exception as a warning names it: its type, its message's first line and, where the message runs on, its
    last (a Triton CompilationError's first line is only "at 22:27:"; the cause is on its last)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    told = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(err).__name__}: {told}"


def first_error_line(log: str) -> str:
    """The compiler's first error line in a build log (ninja prints the command first), else its first line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["(no output)"])[0]


def module_name(isa: str | None = None) -> str:
    """The kernel's module name for `isa` (default: this machine's), keyed by what the build depends on: the
    source's content, torch's version and where it is installed (torch's builder writes the include paths of the
    environment's torch and Python into its build file, and rebuilds when they change), the instruction set and the
    flags. Every checkout of one source in one environment shares one build; a new source, torch or environment
    builds anew, under its own name, and says so."""
    isa = isa or host_isa()
    key = hashlib.sha256()
    parts = (SOURCE.read_bytes(), torch.__version__.encode(), os.path.dirname(torch.__file__).encode(),
             sys.prefix.encode(), isa.encode(), " ".join(build_flags(isa)).encode())  # fmt: skip
    for part in parts:
        key.update(part + b"\0")
    return f"headscope_row_state_{isa.lower()}_{key.hexdigest()[:12]}"


def build_flags(isa: str) -> list[str]:
    return [*CFLAGS, *ISA_FLAGS.get(isa, [])]


def _build_folder(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _staged_source(name: str) -> Path:
    """The source copied into the module's own build folder: torch's builder rebuilds whenever its build file
    names another source path, so the path every checkout builds from is this one."""
    folder = _build_folder(name)
    staged = folder / SOURCE.name
    if not staged.is_file() or staged.read_bytes() != SOURCE.read_bytes():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{SOURCE.name}.{os.getpid()}.tmp"
        partial.write_bytes(SOURCE.read_bytes())
        partial.replace(staged)  # atomic: a concurrent build reads the whole file or the old one
    return staged


BUILD_SECONDS = {"total": 0.0}  # seconds this process spent building the kernel (run.json keeps it apart)


@functools.cache
def row_state_module(isa: str | None = None) -> ModuleType | str:
    """The kernel built for `isa` (default: this machine's), or why it could not be built (one line). A build
    (once per machine, source and torch) is announced, and its time kept in BUILD_SECONDS."""
    isa = isa or host_isa()
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        name = module_name(isa)
        building = not is_built(isa)
        if building:
            _log.warning("building headscope's C++ attention kernel for %s (once per machine, source and torch: "
                         "about a minute)", isa)  # fmt: skip
        module = load(
            name=name,
            sources=[str(_staged_source(name))],
            extra_cflags=build_flags(isa),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a missing BLAS symbol: the tile loop stays
        reason = f"{type(err).__name__}: {first_error_line(str(err))}"
        _log.warning("headscope's C++ attention kernel could not be built (%s); using the tile loop", reason)
        return reason
    finally:
        BUILD_SECONDS["total"] += time.perf_counter() - started
    if building:
        _log.warning("built headscope's C++ attention kernel in %.0f s", time.perf_counter() - started)
    return module


@functools.cache
def triton_module() -> ModuleType | str:
    """The Triton kernel (headscope.model.attention.cuda_kernel), or why it cannot be used (one line): Triton ships with
    torch's CUDA builds; where it is missing or fails to import, the compiled tile loop stays."""
    try:
        from headscope.model.attention import cuda_kernel
    except Exception as err:  # not installed, or a Triton too old for the kernel
        reason = one_line(err)
        _log.warning("headscope's Triton attention kernel is not available (%s); using the tile loop", reason)
        return reason
    return cuda_kernel


def takes_mask(mask: torch.Tensor | None, keys: int) -> bool:
    """Does a kernel take this mask (what the attention function received)? One shared by every head (or none),
    over every key."""
    return mask is None or (mask.shape[1] == 1 and mask.shape[-1] == keys)


def row_state(
    module: ModuleType,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    positions: torch.Tensor,
    first_key: torch.Tensor,
    visibility,
    softcap: float | None,
    window: int,
    *,
    scaling: float,
    out: torch.Tensor | None = None,
    patterns: KeyPatterns | None = None,
) -> tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor, ...] | None]:
    """(states, folded): the states m, A, B, n, top, seen, mean, spread ((batch, heads, rows) each) and O ((batch,
    heads, rows, head_dim), None without `value`), as attention.tile_loop's tile loop leaves them (every key but each
    sentence's first, first_key (batch,) long), of query rows `positions` of query * `scaling` (query: (batch, heads,
    t, head_dim)), then the key points a kernel folds for the read-off (the C++ kernel's four, for the diagonal band
    of half-width `window`; none from the Triton kernel). out ((batch, rows, heads, head_dim) float32, with `value`):
    where the C++ kernel writes the rows' finished output, O then None (the Triton kernel leaves it and returns O).
    folded: what the kernel read of the `patterns`' targets (headscope.model.attention.key_patterns: sum, count,
    best, key, (patterns, batch, heads, rows) each), or None where it reads none (no patterns, or a kernel that does
    not fold them: `folds_patterns`). The mask must be one the kernels take (`takes_mask`: TileKernel.row_state offers
    a kernel only then)."""
    mask = None if visibility.mask is None else visible_keys(visibility.mask)[:, 0].contiguous()
    rows = query if len(positions) == query.shape[2] else query.index_select(2, positions)
    folds = patterns is not None and getattr(module, "folds_patterns", False)
    m, total, weighted, count, top, seen, mean, spread, output, *points = module.row_state(
        rows_adjacent(rows),
        rows_adjacent(key),
        None if value is None else rows_adjacent(value),
        positions.contiguous(),
        first_key.contiguous(),
        mask,
        softcap or 0.0,
        window=window,
        scaling=scaling,
        out=out,
        **(patterns.kernel_arguments() if folds else {}),
    )
    folded = tuple(points[-4:]) if folds else None
    points = points[:-4] if folds else points
    summed = value is not None and output.numel() > 0  # O, not the finished output in `out`
    return (m, total, weighted, count, top, seen, mean, spread, output if summed else None, *points), folded


def rows_adjacent(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when each of its rows (last dimension) is adjacent numbers, as the C++ kernel reads them
    whatever the other strides (the model's projections viewed per head); else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def weight_rows(
    module: ModuleType,
    weights: torch.Tensor,
    visible: torch.Tensor,
    seq_start: torch.Tensor,
    window: int,
    row_offset: int,
) -> RowValues:
    """headscope.measures.row_sums.weight_row_values by the kernel: every row's values of (batch, heads, rows, keys)
    probabilities (any float dtype, read as float32), visible: (batch or 1, 1 or heads, rows, keys) bool."""
    tiny = torch.finfo(weights.dtype).tiny  # as there: ln of the model dtype's smallest normal number at least
    (entropy, max_weight, mass, diagonal, sink, prev_token, band_visible, logit_std, top_key, rest_top_key, n_visible,
     top_tied, rest_top_tied, first_visible, rest_mass, rest_entropy) = module.weight_rows(
        weights.float().contiguous(), visible.contiguous(), seq_start.contiguous(), window, row_offset, tiny
    )  # fmt: skip
    return RowValues(
        entropy=entropy,
        max_weight=max_weight,
        top_key=top_key,
        top_tied=top_tied,
        diagonal=diagonal,
        sink=sink,
        prev_token=prev_token,
        n_visible=n_visible,
        band_visible=band_visible,
        first_visible=first_visible,
        rest_mass=rest_mass,
        rest_entropy=rest_entropy,
        rest_top_key=rest_top_key,
        rest_top_tied=rest_top_tied,
        logit_std=logit_std,
        mass=mass,
    )


def pattern_rows(
    module: ModuleType, weights: torch.Tensor, visible: torch.Tensor, patterns: KeyPatterns, row_offset: int
) -> PatternRows:
    """headscope.model.attention.key_patterns.read_probabilities by the kernel: the patterns' readings of (batch,
    heads, rows, keys) probabilities (any float dtype, read as float32) of query rows row_offset, ...; visible:
    (batch or 1, 1 or heads, rows, keys) bool. A row's targets are looked up, not its keys scanned."""
    match, targets, key, weight = module.pattern_rows(
        weights.float().contiguous(), visible.contiguous(), patterns.sorted_keys.contiguous(),
        patterns.run_begin.contiguous(), patterns.run_end.contiguous(), row_offset,
    )  # fmt: skip
    return PatternRows(match=match, targets=targets, key=key, weight=weight)


def row_sums(
    module: ModuleType,
    values: RowValues,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    row_offset: int,
    *,
    mass_tolerance: float,
    sink_threshold: float,
    value_rows: tuple[int, ...],
    max_offset: int,
    evidence_from: int,
) -> torch.Tensor:
    """headscope.measures.row_sums's `side_by_side_sums` by the kernel, in one pass over the rows: (batch, heads, sums)
    float64 in the order of its SIDE_BY_SIDE (value_rows, max_offset and evidence_from say what that holds)."""
    mass = torch.ones_like(values.entropy) if values.mass is None else values.mass  # None: normalised by construction
    floats = [values.entropy, values.max_weight, mass, values.diagonal, values.sink, values.prev_token,
              values.band_visible, values.logit_std]  # fmt: skip
    return module.row_sums(
        [value.float() for value in floats],
        values.rest_mass.double(),
        values.rest_entropy.double(),
        values.top_key.long(),
        values.top_tied.bool(),
        values.rest_top_key.long(),
        values.rest_top_tied.bool(),
        values.n_visible.long(),
        values.first_visible.bool(),
        query_valid.bool().contiguous(),
        seq_start.long().contiguous(),
        row_offset,
        mass_tolerance,
        sink_threshold,
        list(value_rows),
        max_offset,
        evidence_from,
    )


def write_sums(
    module: ModuleType,
    norms: torch.Tensor,
    residual_norm: torch.Tensor,
    value_norms: torch.Tensor,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    visible: torch.Tensor | None,
) -> torch.Tensor:
    """headscope.measures.writes's sink_value_ratios and head_write_sums in one pass: (batch, heads, 6) float64 in
    the order of its OUTPUT_SLOTS. norms: (batch, heads, t) write norms; residual_norm: (batch, t); value_norms:
    (batch, kv_heads, t) ||v_s||; visible: (batch or 1, 1, t, t) bool, the keys each row sees, or None for causal
    attention over the real keys."""
    return module.write_sums(
        norms.float().contiguous(),
        residual_norm.float().contiguous(),
        value_norms.float().contiguous(),
        query_valid.bool().contiguous(),
        seq_start.long().contiguous(),
        None if visible is None else visible.contiguous(),
    )


def is_built(isa: str | None = None) -> bool:
    """Is the kernel for `isa` (default: this machine's) built already, from today's source and torch? Then loading
    it costs a fraction of a second, not a build. False wherever that cannot be told (a torch whose extension
    builder keeps its folders elsewhere)."""
    try:
        name = module_name(isa)
        return (_build_folder(name) / f"{name}.so").is_file()
    except Exception:  # a private helper of torch's: if it moved, the kernel is built when it pays for itself
        return False
