"""Benchmarks, run as `python -m diprl.bench <name> [options]`.

Each benchmark is a module with a `main(argv) -> int`; `diprl.bench.__main__` maps names to modules so a new
benchmark is one line there and one file here.
"""
