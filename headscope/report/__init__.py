"""Everything that reads a finished report folder. Never imports torch or transformers.

report     the Report: a report's tables and run record, read (every read guarded) or in hand; re-labelled heads
write      a report's charts and page written into its folder, or a new one
charts     DataFrame -> matplotlib Figure, and every chart of a report from its frames (compare_charts,
           patch_charts, prune_chart: those commands' own)
page       report.html and compare.html from assets/ (inspect_page: inspect.html); notebook: every result's view
"""
