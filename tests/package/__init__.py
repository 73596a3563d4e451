"""Tests of deltaserve.package (see the test modules)."""
