"""The run record (run.json) and the checkpoint fingerprint: what a run was, built once from what it measured."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import math
import platform
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata

import torch

from headscope.labels import classification_record
from headscope.layout import SCHEMA_VERSION
from headscope.measures.ov_copying import DEFINITION as COPYING_DEFINITION
from headscope.model.identity import model_identity
from headscope.model.placement import dtype_name
from headscope.summary import layer_entropy

PACKAGES = ("headscope", "torch", "transformers", "tokenizers", "gguf", "pandas", "pyarrow")


@dataclass
class Timings:
    """Seconds spent in each phase of a run, filled as the phases end."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def set_apart(self, name: str, counter: dict[str, float]) -> Iterator[None]:
        """Inside a phase: the seconds `counter["total"]` grows by in the block (a one-off build, say) are kept as
        phase `name`, apart from the phase around them (whose time is taken when the phase ends)."""
        before = counter["total"]
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + counter["total"] - before

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:  # a phase entered twice adds up
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


def fingerprint(loaded, corpus, settings, ranks) -> dict:
    """What must match for a checkpoint to be continued: everything that changes a number.

    Batch size and memory budget are left out: a resumed run batches as the first run did (Plan.sizing).
    """
    placement = ("batch_size", "max_memory", "device_map", "offload_folder", "threads")  # where, not what
    kept = {k: v for k, v in settings.to_dict().items() if k not in placement}
    source = loaded.source
    return {
        "model": [source.kind, source.location, source.gguf_file, loaded.revision],
        "corpus_sha256": corpus.sha256,
        "device": loaded.device.type,
        "dtype": dtype_name(loaded.dtype),
        "settings": kept,
    } | ({"ranks": ranks.world} if ranks.parallel else {})


def run_record(analysis, heads) -> dict:
    """Everything run.json holds about a finished run (analysis: commands.analysis.Analysis; heads: its heads table)."""
    loaded, corpus, plan, measured = analysis.loaded, analysis.corpus, analysis.plan, analysis.measured
    probes, importance, timings = analysis.probes, analysis.importance, analysis.timings
    source, settings = loaded.source, plan.settings
    progress = measured.progress
    # a one-off build of the C++ kernel while measuring is kept apart: it is not what measuring costs
    measure_seconds = timings.seconds.get("measure", 0.0) - timings.seconds.get("kernel_build", 0.0)
    return {
        "schema_version": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "input": source.display,
            "name": source.name,
            "kind": source.kind,
            "location": source.location,
            "gguf_file": source.gguf_file,
            "revision": loaded.revision,
            "architecture": loaded.architecture,
            # each layer's attention as the config declares it: full, or sliding with its window (run.plan)
            "layer_attention": [
                {"layer": layer, "attention": kind, "window": window}
                for layer, (kind, window) in enumerate(plan.attention)
            ],
            "device_map": loaded.device_map,  # module -> device (GPU index, cpu or disk) with --device-map
            **model_identity(loaded),  # weights_sha256, weights_dtype: is a later run's model this one?
        },
        "device": str(loaded.device),
        "dtype": dtype_name(loaded.dtype),
        "attention_implementation": measured.attention_paths,
        # how each layer's attention output reaches the residual stream: description -> layers (headscope.model.
        # write_path); write_norm and write_ratio measure what arrives there
        "write_path": _grouped(measured.write_paths, plan.layers),
        "batching": {**plan.batching(), "batches": progress.batches},
        "corpus": {
            "path": str(corpus.path),
            "sha256": corpus.sha256,
            "sentences": len(corpus.sentences),
            "blank_lines_skipped": corpus.blank_skipped,
            "invalid_utf8_lines": corpus.invalid_lines,
            "tokens": progress.tokens,
            "truncated_sentences": progress.truncated,
            "cut_before_tokenizing": progress.capped,
            "max_length": plan.max_length,
            "empty_sentences": progress.empty_sentences,
        },
        "settings": settings.to_dict(),
        "versions": versions(),
        "timings": {
            "load_seconds": round(timings.seconds.get("load", 0.0), 3),
            "measure_seconds": round(measure_seconds, 3),
            "probe_seconds": round(timings.seconds.get("probes", 0.0), 3),
            "importance_seconds": round(timings.seconds.get("importance", 0.0), 3),
            "dormant_check_seconds": round(timings.seconds.get("dormant_check", 0.0), 3),
            "copying_seconds": round(timings.seconds.get("copying", 0.0), 3),
            "kernel_build_seconds": round(timings.seconds.get("kernel_build", 0.0), 3),
            "write_seconds": round(timings.seconds.get("write", 0.0), 3),
            "tokens_per_second": round(progress.tokens / measure_seconds, 1) if measure_seconds > 0 else None,
            **peak_memory(loaded.device),
        },
        # the dormant label checked by removal (interventions.dormant): its heads, what removing them together cost
        "dormant_check": analysis.dormant.record() if analysis.dormant is not None else None,
        # ov_copying: from the weights (measures.ov_circuits), where W_U came from and whether it was cached
        "copying": {"definition": COPYING_DEFINITION, "from": analysis.copying_from},
        "layer_mean_entropy": [round(float(x), 6) for x in layer_entropy(heads)["mean"]],
        "numerics": {
            "nonfinite_rows": int(heads["nonfinite_rows"].sum()),
            "heads_with_nonfinite_rows": int((heads["nonfinite_rows"] > 0).sum()),
            "unnormalised_rows": int(heads["unnormalised_rows"].sum()),
            "heads_with_unnormalised_rows": int((heads["unnormalised_rows"] > 0).sum()),
        },
        "probes": None
        if probes is None
        else {
            "seeds": settings.probe_seeds,
            "length": settings.probe_length,
            "repeats": probes.repeats,
            "prefix_tokens": probes.prefix,
            "chance": {pattern: round(level, 6) for pattern, level in probes.chance.items()},
            # the retrieval probe (measures.retrieval), with --retrieval-length
            "retrieval": None
            if probes.retrieval is None
            else {"tokens": settings.retrieval_length, "chance": round(probes.retrieval.chance, 6)},
        },
        "bootstrap": {
            "replicates": settings.bootstrap,
            "seed": settings.bootstrap_seed,
            "sentences": progress.measured_sentences,
            "intervals": measured.resampled,
        }
        if settings.bootstrap
        else None,
        "importance": None
        if importance is None
        else {
            "mode": importance.mode,
            "clean_loss": round(importance.clean_loss, 6) if math.isfinite(importance.clean_loss) else None,
            "predicted_tokens": importance.predicted_tokens,
            "ablated_layers": list(plan.layers) if importance.mode == "exact" else [],
            "roles": importance.roles,
            # exact mode: how well each fast estimate ranks the heads as exact ablation does, measured on this run
            "agreement": importance.agreement(),
            "planned": None
            if importance.planned is None
            else {
                "forwards": importance.planned.forwards,
                "token_forwards": round(importance.planned.token_layers / max(plan.depth, 1)),
            },
        },
        "classification": classification_record(heads, analysis.thresholds, analysis.roles),
    }


@functools.cache  # what this process imported does not change while it runs
def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def peak_memory(device: torch.device) -> dict[str, int]:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peaks = {"peak_rss_bytes": int(rss)}
    if device.type == "cuda":
        peaks["peak_cuda_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return peaks


def _grouped(descriptions: list[str], layers) -> dict[str, list[int]] | None:
    """{description: the measured layers it holds for}, or None when no pass learned them."""
    if not descriptions:
        return None
    grouped: dict[str, list[int]] = {}
    for layer in layers:
        if layer < len(descriptions):
            grouped.setdefault(descriptions[layer], []).append(int(layer))
    return grouped
