"""Run the CPU benchmark (same as ``treeattn bench``): ``python bench/cpu.py [--quick] [--dtype fp32 bf16]``."""

import argparse
import sys

from treeattn.cli.bench_cpu import add_cpu_bench_arguments, main_cpu_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_cpu_bench_arguments(parser)
    sys.exit(main_cpu_bench(parser.parse_args()))
