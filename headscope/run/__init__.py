"""What every command run shares: the plan, the corpus and its feed, the corpus pass, checkpoints, ranks,
progress, output folders and the run record; and the two commands that read attention, analyze and inspect."""
