"""Tests of deltaserve.compress (see the test modules)."""
