"""Workloads a user copies from: real models built as Tandem programs.

Their extra dependencies come with the `models` extra: pip install ".[models]".
"""
