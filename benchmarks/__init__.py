"""Benchmarks for clipopt: ``python -m benchmarks.run`` (or ``make bench``).

Times are measured, never asserted: ``tests/test_benchmark_smoke.py`` only checks that
the quick mode runs and reports every section.
"""
