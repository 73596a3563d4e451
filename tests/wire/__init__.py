"""Tests of deltaserve.wire (see the test modules)."""
