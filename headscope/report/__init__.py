"""Everything that reads a finished report folder. Never imports torch or transformers.

folder  read a report's tables and run record (every read guarded); re-label heads; redraw charts
charts  DataFrame -> matplotlib Figure, and drawing every chart of a report from its frames
"""
