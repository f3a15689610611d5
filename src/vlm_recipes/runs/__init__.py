"""A run on disk: the run and stage directories (layout), the one-writer lock, and run.json (manifest)."""
