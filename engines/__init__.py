"""Engine adapters, one folder each; each imports its engine lazily."""
