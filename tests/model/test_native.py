"""headscope's C++ row-statistics kernel (attention.cpu_kernel) against float64 probabilities and the tile loop, and
how the fused pass chooses it (or does without it)."""

from __future__ import annotations

import math
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import headscope
from headscope.measures.statistics import AttentionStatistics
from headscope.model.attention import cpu_kernel
from headscope.model.attention.dispatch import TileKernel
from headscope.model.batch import collate
from headscope.model.capture import attached

from attention_cases import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    assert_matches_reference,
    assert_same_output,
    assert_within,
    bounds,
    fused,
    hand_built,
    masks,
    reference,
    sdpa_output,
)
from helpers import assert_same_heads
from tolerances import UNIT, gamma, logit_error

# Long enough for several blocks of the kernel's rows (64) and keys (512).
LONG = 700


def _variants() -> tuple[str, ...]:
    """Every instruction set torch dispatches to on this architecture (x86: DEFAULT, AVX2, AVX512)."""
    return cpu_kernel.X86_ISAS if platform.machine().lower() in ("x86_64", "amd64") else ("DEFAULT",)


def _host_runs(isa: str) -> bool:
    """Can this CPU run code built for `isa`? (An x86 CPU runs every set up to the one torch dispatches to.)"""
    host = cpu_kernel.host_isa()
    if isa == "DEFAULT" or isa == host:
        return True
    return host in cpu_kernel.X86_ISAS and cpu_kernel.X86_ISAS.index(isa) <= cpu_kernel.X86_ISAS.index(host)


def _compile_only(isa: str) -> subprocess.CompletedProcess:
    """Compile the kernel for `isa` as torch's extension builder does, without running it: compiling for AVX-512
    needs no AVX-512 CPU. `-fsyntax-only`: the compiler's whole analysis of the source, templates instantiated (a
    member torch's AVX-512 vector lacks is an error here), without generating and optimising code (48-62 s against
    82-89 s compiled to code, interleaved on two busy cores)."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    command = [
        shutil.which("c++") or "c++",
        "-DTORCH_EXTENSION_NAME=headscope_row_state_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *includes,
        "-fPIC",
        "-std=c++20",
        *cpu_kernel.CFLAGS,
        *cpu_kernel.ISA_FLAGS[isa],
        "-fsyntax-only",
        str(cpu_kernel.SOURCE),
    ]
    return subprocess.run(command, capture_output=True, text=True, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("isa", _variants())
def test_every_instruction_set_variant_builds_and_the_runnable_ones_agree(isa):
    """torch's vector headers differ per instruction set (an API one set lacks broke the AVX-512 build once, on
    machines the suite never ran on): every variant is compiled here, whatever this CPU, and each variant this
    CPU can run is run against float64 probabilities."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not _host_runs(isa):
        compiled = _compile_only(isa)
        assert compiled.returncode == 0, f"{isa}: {cpu_kernel.first_error_line(compiled.stderr)}"
        return
    module = cpu_kernel.row_state_module(isa)
    assert not isinstance(module, str), f"{isa}: {module}"
    query, key, value = hand_built(seed=9, t=LONG)
    mask, visible, seq_start = masks(t=LONG, window=300)["left padded"]
    kernel = native_kernel(module)
    _, values = fused(query, key, None, mask, seq_start, row_state=kernel.row_state(query, None))
    assert not kernel.failed_kernels
    assert_matches_reference(values, query, key, value, visible, seq_start)


def test_the_kernel_is_built_once_per_source_whichever_checkout_asks(tmp_path, monkeypatch):
    """Two checkouts of one source share one build: its name keys the source's content, torch's version and the
    instruction set, and the source is copied into the build's own folder, so torch's builder (which rebuilds when
    its build file names another source path) always sees the same one. An edited source builds under a new name."""
    checkouts = [tmp_path / name / "row_state.cpp" for name in ("a", "b")]
    for path in checkouts:
        path.parent.mkdir()
        path.write_bytes(cpu_kernel.SOURCE.read_bytes())
    built = []
    for path in checkouts:
        monkeypatch.setattr(cpu_kernel, "SOURCE", path)
        name = cpu_kernel.module_name("AVX2")
        built.append((name, cpu_kernel._staged_source(name)))
    assert built[0] == built[1] and built[0][1].read_bytes() == checkouts[0].read_bytes()
    assert cpu_kernel.module_name("DEFAULT") != built[0][0]  # the instruction set is part of the key
    monkeypatch.setattr(sys, "prefix", "/another/environment")  # its torch and Python headers: another build file
    assert cpu_kernel.module_name("AVX2") != built[0][0]
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernel, "SOURCE", checkouts[1])
    checkouts[1].write_text(checkouts[1].read_text() + "\n// edited\n")
    assert cpu_kernel.module_name("AVX2") != built[0][0]
    assert not cpu_kernel.is_built("AVX2")  # nothing was built from the edited source


def test_is_built_answers_from_the_built_library(kernel_module):
    """The kernel this machine built (conftest) is found as built, whatever the file times of the checkout."""
    if isinstance(kernel_module, str):
        pytest.skip(kernel_module)
    assert cpu_kernel.is_built()
    os.utime(cpu_kernel.SOURCE)  # a fresh clone's source is newer than any build
    assert cpu_kernel.is_built()


def test_a_failed_build_is_reported_by_the_compilers_first_error_line():
    """ninja prints the command before the compiler's output: the reason a user sees is the error itself."""
    log = (
        "Error building extension 'headscope_row_state_avx512': [1/2] c++ -DCPU_CAPABILITY_AVX512 -c row_state.cpp\n"
        "FAILED: row_state.o\n"
        "row_state.cpp: In function 'float reduce_max(Vec)':\n"
        "row_state.cpp:31:40: error: no matching function for call to 'vec_reduce_all<float>'\n"
        "row_state.cpp:35:40: error: no matching function for call to 'vec_reduce_all<float>'\n"
    )
    assert (
        cpu_kernel.first_error_line(log)
        == "row_state.cpp:31:40: error: no matching function for call to 'vec_reduce_all<float>'"
    )
    assert cpu_kernel.first_error_line("ninja is required to load C++ extensions\nmore") == (
        "ninja is required to load C++ extensions"
    )


def native_kernel(module) -> TileKernel:
    return TileKernel(compile_from=0, native_loader=lambda: module, native_from=0)


# A softcap of 10, not 2: over 700 keys, 2 tanh(s / 2) saturates into exact float32 ties the float64 reference lacks.
@pytest.mark.parametrize("softcap", [None, 10.0])
@pytest.mark.parametrize("mask_name", ["causal", "left padded", "sliding window"])
def test_kernel_rows_equal_the_full_probabilities(kernel_module, mask_name, softcap):
    query, key, value = hand_built(seed=4, t=LONG)
    mask, visible, seq_start = masks(t=LONG, window=300)[mask_name]
    kernel = native_kernel(kernel_module)
    row_state = kernel.row_state(query, None)
    assert row_state is not None
    _, values = fused(query, key, None, mask, seq_start, softcap, row_state=row_state)
    assert not kernel.failed_kernels  # its first result agreed with the tile loop
    expected = reference(query, key, value, visible, seq_start, softcap)
    real = visible.any(-1)
    assert_matches_reference(values, query, key, value, visible, seq_start, softcap)
    assert not values.top_tied.transpose(1, 2)[real].any()
    assert torch.equal(values.top_key.transpose(1, 2)[real], expected["top_key"].transpose(1, 2)[real])


def test_a_mask_with_holes_is_read_key_by_key(kernel_module):
    """Padding and sliding windows leave each row one run of keys (the kernel then needs only where it starts);
    a mask hiding every seventh key does not, and the kernel reads it key by key."""
    query, key, value = hand_built(seed=8, t=LONG)
    causal = torch.ones(LONG, LONG).tril().bool()
    holes = causal & (torch.arange(LONG) % 7 != 3)
    holes |= torch.eye(LONG, dtype=torch.bool)  # every row still sees itself
    visible = holes.repeat(2, 1, 1)
    seq_start = torch.zeros(2, dtype=torch.long)
    kernel = native_kernel(kernel_module)
    _, values = fused(query, key, None, holes[None, None], seq_start, row_state=kernel.row_state(query, None))
    assert not kernel.failed_kernels
    assert_matches_reference(values, query, key, value, visible, seq_start)
    assert torch.equal(values.top_key, reference(query, key, value, visible, seq_start)["top_key"])


def test_kernel_rows_equal_the_tile_loop_on_selected_rows_and_ties(kernel_module):
    """Selected rows (the first-call check's), and exact ties: half the heads get a zero query (uniform rows)."""
    query, key, _ = hand_built(seed=5, t=LONG)
    query[:, : HEADS // 2] = 0
    mask, visible, seq_start = masks(t=LONG)["left padded"]
    positions = torch.tensor([0, 3, 5, 6, 63, 64, 65, 511, 512, 513, LONG - 1])
    real = visible.any(-1)[:, positions]
    kernel = native_kernel(kernel_module)
    _, got = fused(query, key, None, mask, seq_start, positions=positions, row_state=kernel.row_state(query, None))
    _, want = fused(query, key, None, mask, seq_start, positions=positions)
    bound = bounds(query, key, torch.zeros_like(query[:, :KV_HEADS]), visible, seq_start)
    for name, value in got.columns().items():
        if name in ("top_key", "rest_top_key"):  # where it means something: the tile loop meets ties in another order
            untied = ~getattr(got, name.replace("key", "tied")) & real[:, None]
            assert torch.equal(value[untied], getattr(want, name)[untied])
            continue
        if not value.is_floating_point():
            assert torch.equal(*torch.broadcast_tensors(value, getattr(want, name))), name
            continue
        # two float32 computations, each within its bound of the exact value (attention_cases.bounds)
        assert_within(value, getattr(want, name), 2 * bound[name][..., positions], real[:, None], name)
    seeing_several = visible.sum(-1)[:, positions] > 1  # (batch, rows)
    assert torch.equal(got.top_tied[:, : HEADS // 2].transpose(1, 2)[real].all(-1), seeing_several[real])


def test_huge_logits_stay_finite_and_exact(kernel_module):
    """Logits in the thousands: float32 logits are then good to ~1e-4 (an ulp at 2,500 is 2.4e-4), whichever
    product computes them, and so are the entropies (the tile loop's as well: 3.3e-5 from float64 here)."""
    query, key, value = hand_built(seed=6, logit_scale=300.0, t=LONG)
    mask, visible, seq_start = masks(t=LONG)["causal"]
    kernel = native_kernel(kernel_module)
    _, values = fused(query, key, None, mask, seq_start, row_state=kernel.row_state(query, None))
    assert torch.isfinite(values.entropy).all()
    assert_matches_reference(values, query, key, value, visible, seq_start, names=["entropy"])


def test_the_kernel_is_only_offered_where_it_applies(kernel_module):
    query, _, _ = hand_built(t=8)
    assert native_kernel(kernel_module).row_state(query, None) is not None
    per_head = torch.ones(2, HEADS, 8, 8, dtype=torch.bool).tril()
    assert native_kernel(kernel_module).row_state(query, per_head) is None  # a mask per head: not taken
    assert native_kernel(kernel_module).row_state(query.double(), None) is None  # float64: the tile loop
    below = TileKernel(native_loader=lambda: kernel_module, native_from=10**9)
    below.step(100)
    assert below.row_state(query, None) is None  # short work: not worth a build


def test_a_kernel_that_cannot_be_built_leaves_the_tile_loop():
    kernel = TileKernel(native_loader=lambda: "OSError: no C++ compiler", native_from=0)
    query, _, _ = hand_built(t=8)
    assert kernel.row_state(query, None) is None
    assert kernel.failed_kernels == {"cpu": "OSError: no C++ compiler"}


def test_a_kernel_whose_first_result_disagrees_is_dropped(caplog):
    """A kernel returning wrong sums is caught by its first-call check, with a warning; the tile loop's numbers
    are returned."""
    query, key, value = hand_built(seed=7, t=40)
    mask, visible, seq_start = masks(t=40)["causal"]

    def wrong(query, key, value, positions, first_key, mask, softcap, **kwargs):
        shape = (query.shape[0], query.shape[1], query.shape[2])
        ones, longs = torch.ones(shape), torch.ones(shape, dtype=torch.long)
        return ones, ones * 2, ones, longs, longs * 0, longs, ones, ones, torch.empty(0)

    kernel = TileKernel(native_loader=lambda: SimpleNamespace(row_state=wrong), native_from=0)
    with caplog.at_level("WARNING", logger="headscope.model.attention.dispatch"):
        _, values = fused(query, key, None, mask, seq_start, row_state=kernel.row_state(query, None))
    assert kernel.failed_kernels["cpu"] == "its first result disagreed with the tile loop"
    assert "C++ attention kernel is dropped (its first result disagreed with the tile loop)" in caplog.text
    assert kernel.row_state(query, None) is None
    assert_matches_reference(values, query, key, value, visible, seq_start, names=["entropy"])


@pytest.mark.parametrize("mask_name", ["causal", "left padded", "sliding window"])
def test_the_kernels_band_spans_key_blocks(kernel_module, mask_name):
    """The diagonal band's mass and count folded by the kernel (not picked key by key) equal the float64
    probabilities' with a band of 600 keys: it spans both blocks of 512 keys, so the mass folded from the first is
    rescaled when the second raises the maximum; rows in blocks of 100 and the default 64, with the output (the
    band summed from the exponentials the output keeps) and without."""
    query, key, value = hand_built(seed=21, t=LONG)
    mask, visible, seq_start = masks(t=LONG)[mask_name]
    window = 600
    expected = reference(query, key, value, visible, seq_start, window=window)
    real = visible.any(-1)[:, None].expand(-1, HEADS, -1)
    for module, values_in in ((kernel_module, None), (with_block_rows(kernel_module, 100), value)):
        kernel = native_kernel(module)
        row_state = kernel.row_state(query, mask)
        _, values = fused(query, key, values_in, mask, seq_start, row_state=row_state, window=window)
        assert kernel.native_runs == 1 and not kernel.failed_kernels
        assert_matches_reference(values, query, key, value, visible, seq_start, names=["diagonal"], window=window)
        counts, want = torch.broadcast_tensors(values.band_visible, expected["band_visible"], values.diagonal)[:2]
        assert torch.equal(counts[real], want[real])


def test_the_kernel_reads_strided_projections_in_place(kernel_module):
    """Queries, keys and values laid out as the model's projections are ((batch, t, heads, head_dim) viewed per
    head, each row's numbers adjacent) give the kernel's results of contiguous copies, bit for bit."""
    query, key, value = hand_built(seed=25, t=LONG)
    mask, _, seq_start = masks(t=LONG)["left padded"]

    def as_projected(x):  # the same numbers, stored (batch, t, heads, head_dim)
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    strided = [as_projected(x) for x in (query, key, value)]
    assert not any(x.is_contiguous() for x in strided)
    positions, mask_rows = torch.arange(LONG), mask[:, 0].contiguous()
    for window in (-1, 2):
        want = kernel_module.row_state(query, key, value, positions, seq_start, mask_rows, 0.0, window=window)
        got = kernel_module.row_state(*strided, positions, seq_start, mask_rows, 0.0, window=window)
        assert len(got) == len(want) == (9 if window < 0 else 13)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_a_kernel_whose_key_points_disagree_is_dropped(kernel_module):
    """The kernel's key points (first and previous key's logits, the band's mass and count) are checked on its first
    call against the read-off's picks: a band mass 1% off drops the kernel, and the numbers are the tile loop's."""
    query, key, value = hand_built(seed=23, t=40)
    mask, visible, seq_start = masks(t=40)["left padded"]

    def off(*args, **kwargs):
        *states, band, band_seen = kernel_module.row_state(*args, **kwargs)
        return (*states, band * 1.01, band_seen)

    kernel = TileKernel(native_loader=lambda: SimpleNamespace(row_state=off), native_from=0)
    _, values = fused(query, key, None, mask, seq_start, row_state=kernel.row_state(query, mask))
    assert kernel.failed_kernels["cpu"] == "its first result disagreed with the tile loop" and kernel.native_runs == 0
    assert_matches_reference(values, query, key, value, visible, seq_start, names=["diagonal"])


@pytest.mark.slow
def test_a_long_text_on_smollm2_takes_the_kernel_and_matches_the_eager_path(smollm2, corpus_lines, kernel_module):
    """700 tokens through 30 layers pass the 2^22-logit threshold in the second layer: the first layer takes the
    tile loop, the rest the kernel, and every head's statistics equal the eager weights' to 1e-5."""
    text = " ".join(corpus_lines)
    eager = headscope.analyze(smollm2, [text], max_length=LONG, sentence_heads=False, charts=None, probes=False)
    fused = headscope.analyze(
        smollm2, [text], max_length=LONG, sentence_heads=False, charts=None, probes=False, block_bytes=2**20
    )
    assert "eager" in eager.run["attention_implementation"]["LlamaAttention"]
    assert "C++ kernel" in fused.run["attention_implementation"]["LlamaAttention"]
    assert_same_heads(fused.heads, eager.heads)


def test_the_kernel_is_counted_only_when_it_ran(kernel_module):
    """run.json names the C++ kernel for a layer only if the kernel computed that layer's rows: a pass it took
    counts, a kernel whose first result was refused does not (the tile loop computed those rows)."""
    query, key, _ = hand_built(seed=3, t=40)
    mask, _, seq_start = masks(t=40)["left padded"]
    kernel = native_kernel(kernel_module)
    fused(query, key, None, mask, seq_start, row_state=kernel.row_state(query, None))
    fused(query, key, None, mask, seq_start, row_state=kernel.row_state(query, None))
    assert kernel.native_runs == 2

    def wrong(query, key, value, positions, first_key, mask, softcap, **kwargs):
        shape = query.shape[:3]
        ones, longs = torch.ones(shape), torch.ones(shape, dtype=torch.long)
        return ones, ones * 2, ones, longs, longs * 0, longs, ones, ones, torch.empty(0)

    refused = TileKernel(native_loader=lambda: SimpleNamespace(row_state=wrong), native_from=0)
    fused(query, key, None, mask, seq_start, row_state=refused.row_state(query, None))
    assert refused.native_runs == 0 and "cpu" in refused.failed_kernels


def with_block_rows(module, rows: int) -> SimpleNamespace:
    """The kernel module with its query rows per task forced to `rows` (row_state leaves them to its rule)."""
    return SimpleNamespace(row_state=lambda *args, **kwargs: module.row_state(*args, rows, **kwargs))


@pytest.mark.parametrize("block_rows", [None, 256, 100], ids=["rows by shape", "256 rows", "100 rows"])
@pytest.mark.parametrize("softcap", [None, 10.0])
@pytest.mark.parametrize("mask_name", ["causal", "left padded", "sliding window"])
def test_kernel_output_equals_sdpa(kernel_module, mask_name, softcap, block_rows):
    """Grouped KV heads (6 on 2) on every mask the kernel takes: its output is sdpa's within 1e-5, the statistics
    from the same pass stay the float64 reference's; with blocks of the 64 rows these 700 take, of the 256 long
    contexts take (two and a partial one), and of 100 (blocks that do not divide the key blocks)."""
    query, key, value = hand_built(seed=11, t=LONG)
    mask, visible, seq_start = masks(t=LONG, window=300)[mask_name]
    module = kernel_module if block_rows is None else with_block_rows(kernel_module, block_rows)
    kernel = native_kernel(module)
    output, values = fused(query, key, value, mask, seq_start, softcap, row_state=kernel.row_state(query, mask))
    assert not kernel.failed_kernels and kernel.native_runs == 1
    real = visible.any(-1)
    assert_same_output(output, sdpa_output(query, key, value, visible, softcap), real, query, key, value, visible,
                       seq_start, softcap)  # fmt: skip
    assert_matches_reference(values, query, key, value, visible, seq_start, softcap)


def test_long_contexts_take_blocks_of_256_rows(kernel_module):
    """The kernel's own rule for its query rows per task: 64 until a KV head's keys and values pass 2 MiB (4,096 keys
    of 64 float32 numbers), 256 from there; 0 (what headscope passes) means that rule, and a count it cannot hold
    is refused."""
    assert kernel_module.block_rows(4096, 64) == 64 and kernel_module.block_rows(4097, 64) == 256
    assert kernel_module.block_rows(2048, 128) == 64 and kernel_module.block_rows(2049, 128) == 256
    query, key, value = hand_built(seed=14, t=40)
    first_key = torch.zeros(2, dtype=torch.long)
    args = (query.contiguous(), key.contiguous(), value.contiguous(), torch.arange(40), first_key)
    by_rule, by_name = kernel_module.row_state(*args, None, 0.0), kernel_module.row_state(*args, None, 0.0, 64)
    assert all(torch.equal(a, b) for a, b in zip(by_rule, by_name, strict=True))
    with pytest.raises(RuntimeError, match="block_rows"):
        kernel_module.row_state(*args, None, 0.0, 257)


def test_kernel_output_through_a_mask_with_holes_and_on_selected_rows(kernel_module):
    query, key, value = hand_built(seed=12, t=LONG)
    causal = torch.ones(LONG, LONG).tril().bool()
    holes = (causal & (torch.arange(LONG) % 5 != 1)) | torch.eye(LONG, dtype=torch.bool)
    seq_start = torch.zeros(2, dtype=torch.long)
    positions = torch.tensor([0, 1, 2, 63, 64, 511, 512, 600, LONG - 1])
    kernel = native_kernel(kernel_module)
    output, _ = fused(
        query, key, value, holes[None, None], seq_start, positions=positions, row_state=kernel.row_state(query, None)
    )
    assert kernel.native_runs == 1
    visible = holes.repeat(2, 1, 1)
    want = sdpa_output(query, key, value, visible)
    bound = 2 * bounds(query, key, value, visible, seq_start)["output"]
    assert_within(output, want[:, positions], bound[:, positions], torch.ones(()).bool(), "output")


@pytest.mark.parametrize("factor", [1.0, 1.01], ids=["as written", "1% off"])
def test_a_kernel_whose_first_output_disagrees_is_dropped(kernel_module, factor):
    """Right statistics, the finished output it writes 1% off: the first-call check refuses it and the tile loop's
    output is returned (the same kernel with its output as written is taken)."""
    query, key, value = hand_built(seed=13, t=LONG)
    mask, visible, seq_start = masks(t=LONG)["left padded"]

    def off(*args, **kwargs):
        states = kernel_module.row_state(*args, **kwargs)
        kwargs["out"].mul_(factor)
        return states

    kernel = TileKernel(native_loader=lambda: SimpleNamespace(row_state=off), native_from=0)
    output, _ = fused(query, key, value, mask, seq_start, row_state=kernel.row_state(query, mask))
    assert kernel.native_runs == (factor == 1.0)
    if factor != 1.0:
        assert kernel.failed_kernels["cpu"] == "its first result disagreed with the tile loop"
    assert_same_output(output, sdpa_output(query, key, value, visible), visible.any(-1), query, key, value, visible,
                       seq_start)  # fmt: skip


@pytest.mark.parametrize("mask_name", ["causal", "left padded", "sliding window"])
def test_the_kernel_writes_the_finished_output_where_it_is_told(kernel_module, mask_name):
    """Given `out` (here a (batch, t, heads, head_dim) view of a (batch, heads, t, head_dim) buffer), the kernel
    writes every row's finished output there and returns no sums: sdpa's output within 1e-5 on rows that see a key,
    exactly 0 on rows that see none (padding); and the logits it scales itself (`scaling`) give the state of the
    scaled copy of the queries within float32 rounding."""
    query, key, value = hand_built(seed=15, t=LONG)
    mask, visible, seq_start = masks(t=LONG, window=300)[mask_name]
    mask_rows = None if mask is None else mask[:, 0].contiguous()
    arguments = (key, value, torch.arange(LONG), seq_start, mask_rows, 0.0)
    scaling = HEAD_DIM**-0.5
    out = torch.full((2, HEADS, LONG, HEAD_DIM), math.nan).transpose(1, 2)
    states = kernel_module.row_state(query, *arguments, scaling=scaling, out=out)
    assert states[8].numel() == 0
    real = visible.any(-1)
    assert_same_output(out, sdpa_output(query, key, value, visible), real, query, key, value, visible, seq_start)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    copied = kernel_module.row_state(query * scaling, *arguments)
    # Each side's logits within logit_error of the exact ones (q * scaling rounds once more: one more ulp), so the
    # two within delta of each other: the maxima and moments within delta, the sums of exponentials within
    # e^(2 delta) - 1 of themselves, plus the float32 sums over the row's keys.
    delta = 2 * float(logit_error(query, key, scaling).amax()) + 2 * UNIT * float(query.abs().amax() * scaling)
    for got, want in zip(states[:8], copied[:8], strict=True):
        torch.testing.assert_close(got, want, rtol=math.expm1(2 * delta) + gamma(LONG), atol=LONG * delta)


@pytest.mark.slow
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_the_kernel_outputs_carry_smollm2_to_the_sdpa_hidden_state(smollm2, corpus_lines, kernel_module, padding_side):
    """Two texts of 700 and 420 tokens in one padded batch: every layer's output from the kernel (none from sdpa),
    and the model's last hidden state equal to its plain sdpa forward's within 1e-5 of its scale on real tokens."""
    text = " ".join(corpus_lines)
    ids = [smollm2.tokenizer(text)["input_ids"][:length] for length in (LONG, 420)]
    batch = collate([0, 1], ids, padding_side=padding_side)
    measure = AttentionStatistics(window=2, sink_threshold=0.3, accum_dtype=torch.float64)
    with attached(smollm2.model, block_bytes=2**20) as capture:
        measured = capture.run(batch, measures=[measure])
        paths = set(capture.paths.values())
    assert paths == {"fused (output and row statistics in one pass by headscope's C++ kernel)"}
    before = smollm2.model.config._attn_implementation
    smollm2.model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            plain = smollm2.model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
            ).last_hidden_state
    finally:
        smollm2.model.set_attn_implementation(before)
    real = batch.attention_mask.bool()
    got, want = measured.last_hidden_state[real], plain[real]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), float((got - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_read_as_float32(kernel_module, dtype):
    """A half-precision layer reaches the kernel: its numbers are exact in float32, so the statistics equal the
    float64 reference of those very numbers to 1e-5, and the output is float32 sdpa's rounded once to the layer's
    dtype (within half its epsilon)."""
    query, key, value = (x.to(dtype) for x in hand_built(seed=14, t=LONG))
    mask, visible, seq_start = masks(t=LONG)["left padded"]
    kernel = native_kernel(kernel_module)
    row_state = kernel.row_state(query, mask)
    assert row_state is not None
    output, values = fused(query, key, value, mask, seq_start, row_state=row_state)
    assert not kernel.failed_kernels and kernel.native_runs == 1 and output.dtype == dtype
    exact = [x.float() for x in (query, key, value)]
    real = visible.any(-1)
    want = sdpa_output(*exact, visible)[real]
    half_ulp = torch.finfo(dtype).eps / 2 * want.abs()
    bound = 2 * bounds(*exact, visible, seq_start)["output"][real]  # float32 sdpa's and the kernel's rounding
    assert ((output[real].float() - want).abs() <= half_ulp + bound).all()
    assert_matches_reference(values, *exact, visible, seq_start)


def test_a_kernel_that_raises_is_dropped_for_the_tile_loop():
    """A kernel that fails on its first call (a Triton kernel that does not compile on this GPU, a refused input)
    is dropped with its reason: the tile loop computes that pass, the output included, and every later one."""
    query, key, value = hand_built(seed=15, t=40)
    mask, visible, seq_start = masks(t=40)["left padded"]

    def broken(*args, **kwargs):
        raise RuntimeError("at 22:27:\n    m = tl.full([BLOCK_M], LOWEST)\n\nNameError: LOWEST is not a constexpr")

    kernel = TileKernel(native_loader=lambda: SimpleNamespace(row_state=broken), native_from=0)
    output, values = fused(query, key, value, mask, seq_start, row_state=kernel.row_state(query, mask))
    # one line, with the message's last line where its first says only where (Triton's CompilationError on an H200)
    assert kernel.failed_kernels == {"cpu": "failed (RuntimeError: at 22:27: ... NameError: LOWEST is not a constexpr)"}
    assert kernel.row_state(query, mask) is None and kernel.native_runs == 0
    real = visible.any(-1)
    assert_same_output(output, sdpa_output(query, key, value, visible), real, query, key, value, visible, seq_start)
    assert_matches_reference(values, query, key, value, visible, seq_start, names=["entropy"])


CANNOT_BUILD = """
import torch
from attention_cases import assert_same_output, fused, hand_built, masks, sdpa_output
from headscope.model.attention.dispatch import TileKernel

query, key, value = hand_built(seed=16, t=40)
mask, visible, seq_start = masks(t=40)["left padded"]
kernel = TileKernel(native_from=0)  # the real loader: torch's extension builder
output, _ = fused(query, key, value, mask, seq_start, row_state=kernel.row_state(query, mask))
want = sdpa_output(query, key, value, visible)
assert_same_output(output, want, visible.any(-1), query, key, value, visible, seq_start)
print(kernel.failed_kernels["cpu"])
"""


@pytest.mark.slow
def test_a_machine_that_cannot_build_the_kernel_keeps_the_tile_loop_with_a_warning(tmp_path):
    """A compiler that fails (CXX=false) in a fresh extensions folder: the build's failure is one warning line, the
    reason is kept, and the tile loop computes the output and the statistics."""
    support = Path(__file__).resolve().parents[1] / "support"
    env = {**os.environ, "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(support)}
    done = subprocess.run([sys.executable, "-c", CANNOT_BUILD], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "could not be built" in line]
    assert len(warnings) == 1 and "using the tile loop" in warnings[0], done.stderr[-2000:]
    assert done.stdout.strip(), "no reason kept"
