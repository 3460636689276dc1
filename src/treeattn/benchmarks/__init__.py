"""Benchmarks that ship with the package, so ``treeattn bench`` can run them on any machine."""
