"""A user's training job recorded where it runs (`recorder.Recorder`), in one versioned format
(`format`), its gradients kept as linear sketches (`sketch`), its rows as fingerprints (`rows`);
compared by `gatherlab.compare` (docs/design.md §11)."""
