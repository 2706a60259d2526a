"""What every command run shares: the plan, the corpus and its feed, the corpus pass, checkpoints, ranks,
progress, the opening of the model and the run record.

Modules:
    checkpoint     Where measured chunks go until the report is complete: part files, and resumable checkpoints
    corpus         Read and validate sentence corpora
    corpus_pass    The corpus pass: every chunk of the feed through the attached model, the statistics riding on it
    distributed    Data-parallel runs on torch.distributed: `torchrun --nproc-per-node N -m headscope analyze ...`
    example_views  The report's example views: every head's attention on a few short corpus sentences
    feed           The host side of a run: sentences -> token ids -> padded batches on the device
    head_evidence  What the corpus pass keeps besides the statistics
    opening        Opening the model for a run: the settings checked against its config and the tokenizer checked
    plan           The plan of a run: everything a pass needs, resolved once from the settings and the model's config
    prefetch       Run a producer a few items ahead in a background thread, so that host work overlaps the model
    progress       How progress looks: ``RichReporter``
    record         The run record (run.json) and the checkpoint fingerprint
    setup          The set-up every model command shares, written once
"""
