"""What each kind of folder headscope writes holds, and how to tell one from anything else.

Every command that writes a folder writes one of these kinds, each recognised by its record file: a report
(`analyze`, `classify --out`: run.json), a comparison (`compare`: compare.json), charts drawn elsewhere
(`plot --out`: plot.json), an inspection (`inspect`: inspect.json), an ablation (`ablate`: ablation.json), a
patching (`patch`: patch.json), a pruning (`prune`: prune.json) and a pruned model (`prune --save-model`:
pruned.json).
Each command's entry in registry.py names the kinds it writes (a `Kind`: its record and every other file), and
`output.why_not_replaceable` is the one rule every writing command follows: a folder is written only when it is
empty or missing, and replaced (with --overwrite) only when it is a headscope folder of the same kind, holding
nothing but the files that kind writes. These lists are the files headscope may ever replace or delete.
No third-party imports: an output folder is checked before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from headscope.config import CHART_FORMATS

SCHEMA_VERSION = 10  # of the tables and run.json; bumped when a column or key is added, changes or goes away

HEADS_FILE = "heads.parquet"
SENTENCES_FILE = "sentences.parquet"
SENTENCE_HEADS_FILE = "sentence_heads.parquet"
EXAMPLES_FILE = "examples.parquet"
LAYERS_FILE = "layers.parquet"
PROBES_FILE = "probes.parquet"
EXEMPLARS_FILE = "exemplars.parquet"
RUN_FILE = "run.json"
TABLE_FILES = (
    *(HEADS_FILE, LAYERS_FILE, SENTENCES_FILE, SENTENCE_HEADS_FILE, EXAMPLES_FILE, PROBES_FILE, EXEMPLARS_FILE),
)

CHART_NAMES = (
    "entropy_heatmap",
    "layer_gradient",
    "head_types",
    "head_roles",
    "probe_scores",
    "importance_heatmap",
    "importance_entropy",
    "classification_map",
    "examples",
)

PAGE_FILE = "report.html"  # the self-contained page of a report
COMPARE_PAGE = "compare.html"
PLOT_RECORD = "plot.json"  # what `plot --out` drew, from which report

# What `headscope compare` writes: a folder of its own, recognised by compare.json.
COMPARE_RECORD = "compare.json"
COMPARE_FILE = "compare.parquet"
COMPARE_LAYERS_FILE = "compare_layers.parquet"
COMPARE_BANDS_FILE = "compare_bands.parquet"
COMPARE_TABLES = (COMPARE_FILE, COMPARE_LAYERS_FILE, COMPARE_BANDS_FILE)
COMPARE_CHARTS = ("delta_heatmap", "layer_gradients", "transitions", "band_shares")


# What `headscope inspect` writes: chosen heads' whole attention on chosen texts, recognised by inspect.json.
INSPECT_RECORD = "inspect.json"
ATTENTION_FILE = "attention.parquet"
TOKENS_FILE = "tokens.parquet"
INSPECT_PAGE = "inspect.html"
QK_FILE = "qk.parquet"  # with --why: the explained rows' split logits

# What `headscope ablate` writes: groups of heads removed together, recognised by ablation.json.
ABLATION_RECORD = "ablation.json"

# What `headscope patch` writes: heads patched between prompt pairs, recognised by patch.json.
PATCH_RECORD = "patch.json"
PATCHING_FILE = "patching.parquet"
PATCHING_PAIRS_FILE = "patching_pairs.parquet"
PATCH_CHARTS = ("patch_heatmap", "patch_positions")

# What `headscope circuit` writes: every edge's score and every component's direct logit attribution, recognised by
# circuit.json.
CIRCUIT_RECORD = "circuit.json"
EDGES_FILE = "edges.parquet"
NODES_FILE = "nodes.parquet"
EDGES_BY_ROLE_FILE = "edges_by_role.parquet"  # with --by-role
CIRCUIT_WHY_FILE = "why.parquet"  # with --why: what moves the explained heads' attention to each role's token
CIRCUIT_PAGE = "circuit.html"
CIRCUIT_CHARTS = ("circuit_graph", "circuit_faithfulness")
# an interrupted circuit's checkpoint (commands/circuit_resume.py): its edge scores, and the edge sets patched so far
CIRCUIT_SCORES, CIRCUIT_PATCHED = "circuit-scores.npz", "circuit-patched.npz"

# What `headscope prune` writes, recognised by prune.json; --save-model writes a transformers checkpoint into a
# folder of its own, recognised by pruned.json beside the files transformers writes.
PRUNE_RECORD = "prune.json"
PRUNE_JOURNAL = "prune-journal.json"  # an interrupted prune --resume's checkpoint (interventions/journal.py)
HEAD_MASK_FILE = "head_mask.parquet"
PRUNE_PAGE = "prune.html"  # the heads on the grid, coloured by what the search did to each, and its curve
KV_POLICY_RECORD = "kv-policy.json"  # prune --mode window: the windowed heads as a KV-cache policy (kv_policy.py)
PRUNE_CHARTS = ("prune_curve", "streaming_heads")  # streaming_heads: window mode's kv-policy.json on the grid
PRUNED_MODEL_RECORD = "pruned.json"
CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json",
)  # fmt: skip


@dataclass(frozen=True)
class Kind:
    name: str  # as messages say it: "a headscope report"
    record: str  # the file that says a folder is of this kind, written by headscope
    files: tuple[str, ...]  # every other file it may hold
    charts: tuple[str, ...] = ()  # chart names, in any of CHART_FORMATS
    option: str = "--out"  # the option that names such a folder, as messages say it

    def holds(self, name: str) -> bool:
        stem, _, extension = name.rpartition(".")
        return name == self.record or name in self.files or (stem in self.charts and extension in CHART_FORMATS)
