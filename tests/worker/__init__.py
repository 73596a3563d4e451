"""Tests of deltaserve.worker (see the test modules)."""
