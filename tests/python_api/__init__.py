"""Tests of the Python API over the router: deltaserve.LLM, deltaserve.Server and the console script."""
