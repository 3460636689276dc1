"""Benchmark the paged KV cache (one tree-decoding step): ``python bench/cache.py [--quick] [--out bench/results/cache.md]``."""

import argparse
import sys

from treeattn.cli.bench_cache import add_cache_bench_arguments, main_cache_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_cache_bench_arguments(parser)
    sys.exit(main_cache_bench(parser.parse_args()))
