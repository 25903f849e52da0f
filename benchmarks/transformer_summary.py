#!/usr/bin/env python3
"""One table from the JSON results of bench_transformer and reference_transformer.py (and the
headline figures of bench_cuda): what scripts/device_perf.sh prints last and writes to
summary.md. Missing files are skipped.

  python3 benchmarks/transformer_summary.py --ours A.json [--ours-groups B.json] \\
      [--reference C.json] [--reference-groups D.json] [--bench-cuda E.json] [--markdown OUT.md]
"""

import argparse
import json
import os
import sys


def load(path):
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def fmt(value, digits):
    return "—" if value is None else f"{value:.{digits}f}"


def ratio(a, b):
    return "—" if a is None or not b else f"{a / b:.2f}x"


def rows_of(results, who, groups):
    """(label, solver result, harness MB) rows of one results file."""
    if results is None:
        return []
    suffix = " (21 groups)" if groups else ""
    harness = results.get("harness_bytes", 0) / 1e6
    return [(f"{who} {s['name']}{suffix}", s, harness) for s in results["solvers"]]


def reference_baselines(reference):
    """Reference figures by setting name: the denominators of the ratio columns."""
    if reference is None:
        return {}
    return {s["name"]: s for s in reference["solvers"] if not s.get("error")}


def table(rows, baselines, frequency):
    eigh = baselines.get("eigh", {})
    newton = baselines.get("coupled-newton", {})
    lines = [
        f"| setting | f={frequency} ms/step | plain step ms | root ms | f=1 ms/step | peak MB | "
        f"harness MB | f={frequency} / ref eigh | f={frequency} / ref CN | f=1 / ref eigh |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s, harness in rows:
        if s.get("error"):
            lines.append(f"| {label} | failed: {s['error'][:100]} | | | | | | | | |")
            continue
        peak = s.get("peak_bytes")
        lines.append(
            f"| {label} | {fmt(s['amortized_ms'], 2)} | {fmt(s['plain_step_ms'], 2)} | "
            f"{fmt(s['root_ms'], 1)} | {fmt(s['every_step_ms'], 1)} | "
            f"{fmt(peak / 1e6 if peak is not None and peak >= 0 else None, 1)} | {harness:.1f} | "
            f"{ratio(s['amortized_ms'], eigh.get('amortized_ms'))} | "
            f"{ratio(s['amortized_ms'], newton.get('amortized_ms'))} | "
            f"{ratio(s['every_step_ms'], eigh.get('every_step_ms'))} |")
    return lines


def bench_cuda_lines(bench_cuda):
    if bench_cuda is None:
        return []
    lines = ["", "bench_cuda:"]
    t = bench_cuda.get("training")
    if t:
        lines.append(f"  ConvNet step (batch {t['batch']}, frequency {t['frequency']}): Shampoo "
                     f"{t['shampoo_ms']:.2f} ms, Adam {t['adam_ms']:.2f} ms, ratio "
                     f"{t['ratio']:.2f}x")
    for r in bench_cuda.get("roots", []):
        lines.append(f"  roots {r['n']}x{r['d']}: ours {r['ours_ms']:.3g} ms, "
                     f"linalg_eigh + bmm {r['torch_ms']:.3g} ms")
    return lines


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("ours", "ours-groups", "reference", "reference-groups", "bench-cuda",
                 "markdown"):
        parser.add_argument(f"--{name}", default="")
    args = parser.parse_args(argv)
    ours, ours_groups = load(args.ours), load(args.ours_groups)
    reference, reference_groups = load(args.reference), load(args.reference_groups)
    first = next((r for r in (ours, reference, ours_groups, reference_groups) if r), None)
    frequency = first["settings"]["frequency"] if first else 20
    rows = (rows_of(ours, "ours", False) + rows_of(reference, "reference", False)
            + rows_of(ours_groups, "ours", True) + rows_of(reference_groups, "reference", True))
    lines = table(rows, reference_baselines(reference), frequency)
    if first:
        s = first["settings"]
        lines += ["", f"f={frequency}: mean over windows of {s['window']} steps (median of "
                      f"{s['repetitions']}); f=1: median of {s['every_step_steps']} steps; peak "
                      "MB (1e6 bytes) includes the harness's tensors (harness MB). 21-group rows: "
                      "f=1 not run."]
    lines += bench_cuda_lines(load(args.bench_cuda))
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
