"""Weights: the single-file bundle format, its validation, the loaded ModelSet, the embedded default."""
