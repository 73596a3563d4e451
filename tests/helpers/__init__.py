"""Test helpers shared across test files (tiny HF checkpoints with real tokenizers)."""
