#!/usr/bin/env python3
"""The Python package's step against the reference's and against its own C++ engine.

1. Reference vs distributed_shampoo_cpp: benchmarks/reference_transformer.py, unchanged, run once
   with the reference's `distributed_shampoo` package and once with a one-file package of the
   same name that re-exports distributed_shampoo_cpp (the one-import switch a user makes). Same
   workload, settings and protocol (its docstring); the two alternate for --rounds rounds, each
   its own process; medians over the rounds.
2. The binding's overhead: in one process, on the same workload, the Python class's step()
   (param_groups read, floats pushed, step counts written back) against the engine's step called
   directly (the C++ DistributedShampoo::step through the extension, nothing else), alternating
   in windows of --window plain steps (roots once at step 1, then never), medians of the windows.

    PYTHONPATH=build/python:<torch site> python3 benchmarks/bench_python.py \\
        --reference-path DIR [--workload mlp] [--max-dim 512] [--frequency 20] [--window 40] \\
        [--repetitions 3] [--rounds 2] [--threads T] [--json PATH]
DIR holds the reference's `distributed_shampoo` package (git archive of facebookresearch/optimizers).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = "from distributed_shampoo_cpp import *  # noqa: F401,F403\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference-path", required=True)
    parser.add_argument("--workload", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--max-dim", type=int, default=512)
    parser.add_argument("--frequency", type=int, default=20)
    parser.add_argument("--window", type=int, default=40)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", default="")
    return parser.parse_args(argv)


def run_reference_script(package_dir, args, label):
    """reference_transformer.py with `distributed_shampoo` from package_dir; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.join(HERE, "reference_transformer.py"),
                   "--reference-path", package_dir, "--workload", args.workload,
                   "--max-dim", str(args.max_dim), "--device", "cpu", "--root-inv", "eigh",
                   "--frequency", str(args.frequency), "--window", str(args.window),
                   "--repetitions", str(args.repetitions), "--steps", "0",
                   "--threads", str(args.threads), "--json", out, "--label", label]
        print(f"[bench_python] {label}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True)
        with open(out) as f:
            return json.load(f)["solvers"][0]


def compare_with_reference(args):
    """Medians over the rounds of (reference, ours) amortized and plain-step times."""
    results = {"reference": [], "ours": []}
    with tempfile.TemporaryDirectory() as shim:
        os.makedirs(os.path.join(shim, "distributed_shampoo"))
        with open(os.path.join(shim, "distributed_shampoo", "__init__.py"), "w") as f:
            f.write(SHIM)
        for r in range(args.rounds):
            order = [("reference", args.reference_path), ("ours", shim)]
            for label, path in order if r % 2 == 0 else reversed(order):
                results[label].append(run_reference_script(path, args, label))
    summary = {}
    for label, runs in results.items():
        for key in ("amortized_ms", "plain_step_ms", "root_ms"):
            summary[f"{label}_{key}"] = statistics.median(run[key] for run in runs)
    summary["amortized_ratio"] = summary["ours_amortized_ms"] / summary["reference_amortized_ms"]
    summary["plain_ratio"] = summary["ours_plain_step_ms"] / summary["reference_plain_step_ms"]
    return summary


def binding_overhead(args):
    """Median ms of a plain step through the Python class and through the engine directly."""
    sys.path.insert(0, HERE)
    import torch
    import distributed_shampoo_cpp as ds
    import reference_transformer as rt

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    workload = rt.Workload(torch, torch.device("cpu"), False, args.workload)
    optimizer = ds.DistributedShampoo(
        workload.params, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=1e-5,
        max_preconditioner_dim=args.max_dim, precondition_frequency=10**9,
        start_preconditioning_step=1,
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8))
    steps = {"python": optimizer.step, "engine": optimizer._engine.step}
    windows = {"python": [], "engine": []}
    taken = 0
    for _ in range(3):  # warm-up: roots at step 1
        workload.set_gradients(taken)
        optimizer.step()
        taken += 1
    for r in range(args.repetitions * 2):
        for name in (("python", "engine") if r % 2 == 0 else ("engine", "python")):
            times = []
            for _ in range(args.window):
                workload.set_gradients(taken)
                begin = time.perf_counter()
                steps[name]()
                times.append((time.perf_counter() - begin) * 1e3)
                taken += 1
            windows[name].append(statistics.median(times))
    python_ms = statistics.median(windows["python"])
    engine_ms = statistics.median(windows["engine"])
    return {"python_step_ms": python_ms, "engine_step_ms": engine_ms,
            "overhead": python_ms / engine_ms - 1.0, "windows": windows}


def main(argv):
    args = parse_args(argv)
    overhead = binding_overhead(args)
    print(f"[bench_python] binding: Python step {overhead['python_step_ms']:.3f} ms, engine step "
          f"{overhead['engine_step_ms']:.3f} ms, overhead {overhead['overhead'] * 100:+.1f} %",
          flush=True)
    reference = compare_with_reference(args)
    print("\n| | reference | distributed_shampoo_cpp | ratio |\n|---|---|---|---|")
    for key, name in (("amortized_ms", f"f={args.frequency} ms/step"),
                      ("plain_step_ms", "plain step ms"), ("root_ms", "root ms")):
        ours, theirs = reference[f"ours_{key}"], reference[f"reference_{key}"]
        print(f"| {name} | {theirs:.2f} | {ours:.2f} | {ours / theirs:.2f}x |")
    print(f"| binding overhead (Python step / engine step - 1) | | "
          f"{overhead['overhead'] * 100:+.1f} % | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "reference": reference, "binding": overhead}, f,
                      indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
