"""Tests of the CPU LoRA helpers (``deltaserve.helpers``)."""
