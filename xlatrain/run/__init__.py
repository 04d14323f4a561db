"""The run directory and what a run leaves in it: the directory and its lock, checkpoints and their
fingerprints, metrics and session summaries, and files replaced whole."""
