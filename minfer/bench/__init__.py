"""Benchmark machinery shared by apps/benchmark.py and apps/profile.py."""
