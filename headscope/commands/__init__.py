"""The library's commands: one module per command (analyze, inspect, ablate, prune, patch), each its entry point
and its result. They sit on every other floor (run/ for the corpus and the output folder, interventions/ for
removing heads, measures/ and model/ beneath) and only cli/ and the package's API sit on them."""
