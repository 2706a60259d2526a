"""The library's commands: one module per command (analyze, inspect, ablate, prune, patch, circuit, copying), each its
entry point and its result, and the modules a command's work is split into. They sit on every other floor (run/ for
the corpus and the output folder, interventions/ for removing heads, measures/ and model/ beneath) and only cli/ and
the package's API sit on them.

Modules:
    ablate          ablate(): does the model need these heads together? The corpus loss with groups of heads removed
    analysis        From what the passes measured to the report's tables and run.json
    analyze         analyze(): the one entry point the CLI (and notebooks) call
    circuit         circuit(): which components feed which, for prompt pairs
    circuit_resume  circuit's checkpoint: an interrupted run continues where it stopped (`--resume`)
    circuit_why     circuit --why N: why the heads the N strongest q and k edges feed attend, at each pair's END row
    copying         copying(): what each head's weights copy, with no data
    exemplar_texts  What `inspect --exemplars L.H REPORT` opens
    inspect         inspect(): chosen heads' whole attention on chosen texts, token by token
    patch           patch(): which heads carry a behaviour? Activation patching of each head on prompt pairs
    prune           prune(): as many heads removed together as a loss budget allows
    why_rows        inspect --why: which senders make a head's query match a key, for chosen rows of the inspected texts
"""
