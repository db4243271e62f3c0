"""enginecore benchmarks: each script measures the project next to its raw baseline.

Run them all with ``python -m benchmarks`` (``--quick`` for a smoke run), or one alone with
``python -m benchmarks.bench_<name>``. See ``docs/performance.md``.
"""
