#!/usr/bin/env python3
"""Attributes `perf` samples to the benchmark steps they fell in, per configuration.

A benchmark run with --verbose prints every timed step with its CLOCK_MONOTONIC start (and end, or
its duration); `perf record -k mono` stamps samples with the same clock. This script reads both
and prints, per configuration, the samples per step, the share of them in the kernel's page-fault
and munmap paths (memory mapped fresh at every step), and the leaf symbols with the most samples
per step. At -F 999 one sample is about one millisecond of CPU.

    perf record -k mono -F 999 -g -o vg.data \
        build-bench/benchmarks/bench_virtual_groups --threads 1 --verbose > vg.log
    perf script -i vg.data -F time,ip,sym > vg.script
    python3 benchmarks/perf_by_step.py vg.log vg.script [--top 15]
"""

import argparse
import bisect
import collections
import re

STEP = re.compile(
    r"^\s+step (?P<name>.+?) (?P<step>\d+) start (?P<start>[\d.]+) s, "
    r"(?:end (?P<end>[\d.]+) s, )?(?P<ms>[\d.]+) ms"
)
# Kernel frames that mean "this sample was spent faulting in or unmapping memory".
MEMORY_FRAMES = ("page_fault", "do_anonymous_page", "munmap", "unmap_page_range", "unmap_vmas")


def read_steps(path):
    steps = []
    with open(path) as log:
        for line in log:
            m = STEP.match(line)
            if not m:
                continue
            start = float(m["start"])
            end = float(m["end"]) if m["end"] else start + float(m["ms"]) / 1000.0
            steps.append((start, end, m["name"]))
    steps.sort()
    return steps


def read_samples(path):
    """Yields (time, frames): frames[0] is the leaf; one frame when recorded without -g."""
    time, frames = None, []
    with open(path) as script:
        for line in script:
            if not line.strip():
                continue
            if not line.startswith("\t"):
                if time is not None:
                    yield time, frames
                head = line.split(":", 1)
                time = float(head[0])
                rest = head[1].split(None, 1) if len(head) > 1 else []
                # Without call chains the sample line itself holds "ip sym".
                frames = [rest[1].strip()] if len(rest) > 1 else []
            else:
                parts = line.strip().split(None, 1)
                frames.append(parts[1] if len(parts) > 1 else "?")
    if time is not None:
        yield time, frames


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", help="the benchmark's --verbose output")
    parser.add_argument("script", help="perf script -F time,ip,sym output")
    parser.add_argument("--top", type=int, default=15, help="leaf symbols shown per configuration")
    args = parser.parse_args()

    steps = read_steps(args.log)
    if not steps:
        raise SystemExit(f"{args.log}: no '    step ... start ...' lines (run with --verbose)")
    starts = [s[0] for s in steps]
    steps_of = collections.Counter(name for _, _, name in steps)
    samples = collections.Counter()
    memory = collections.Counter()
    leaves = collections.defaultdict(collections.Counter)
    for time, frames in read_samples(args.script):
        i = bisect.bisect_right(starts, time) - 1
        if i < 0 or time > steps[i][1]:
            continue
        name = steps[i][2]
        samples[name] += 1
        if any(marker in f for f in frames for marker in MEMORY_FRAMES):
            memory[name] += 1
        leaf = re.sub(r"\+0x[0-9a-f]+$", "", frames[0]) if frames else "?"
        leaves[name][leaf[:90]] += 1

    print(f"{'configuration':<24}{'steps':>7}{'samples/step':>14}{'page-fault/munmap':>19}")
    for name in sorted(steps_of, key=list(steps_of).index):
        n = steps_of[name]
        print(f"{name:<24}{n:>7}{samples[name] / n:>14.2f}{memory[name] / n:>19.2f}")
    for name in sorted(steps_of, key=list(steps_of).index):
        n = steps_of[name]
        print(f"\n{name}: leaf symbols, samples per step")
        for leaf, count in leaves[name].most_common(args.top):
            print(f"  {count / n:8.2f}  {leaf}")


if __name__ == "__main__":
    main()
