"""Tests of deltaserve.adapters (see the test modules)."""
