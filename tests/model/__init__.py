"""Tests of deltaserve.model (see the test modules)."""
