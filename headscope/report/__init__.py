"""Everything that reads a finished report folder. Never imports torch or transformers.

Modules:
    charts          Charts: a tidy DataFrame in, a matplotlib Figure out
    circuit_charts  The charts of a circuit (matplotlib only; no torch)
    circuit_page    circuit.html: the circuit as a graph, its faithfulness curve and its strongest edges
    compare         Two finished reports -> what changed, head by head
    compare_charts  Charts of a comparison: DataFrames in, matplotlib Figures out (and `draw_comparison` saves them)
    inspect_page    inspect.html: one view per chosen head and text
    notebook        Results in a notebook cell: the HTML behind every result object's `_repr_html_`
    page            report.html and compare.html: one self-contained page each
    palette         One set of colours for the PNG charts and the page (which receives them in its data)
    patch_charts    The charts of a patching (matplotlib only; no torch)
    prune_chart     The charts of a pruning: verified loss against heads removed, and window mode's policy on the grid
    prune_page      prune.html: a pruning's heads on the grid, coloured by what the search did to each, and its curve
    report          A finished report: its run record, its tables (read when first used
    sentence_rows   A sentence_heads table read back sentence by sentence, a bounded number at a time
    write           Writing what reads a report: charts and report.html (analyze, plot), relabelled heads (classify)
"""
