#!/usr/bin/env python3
"""The transformer-like workload of issue 13 on the reference Python implementation.

The counterpart of bench_transformer (benchmarks/bench_transformer.cpp): the same parameters and
gradients (torch's CPU generator seeded with 0, drawn in the same order), the same Shampoo
settings and the same measurement protocol and table, for the reference's default inverse roots
(eigendecomposition) and its coupled Newton iteration (its defaults).

Protocol, per root-inverse setting, one optimizer alive at a time:
  f=N (precondition_frequency N, default 20): warm-up through the first root computation (step
    N), then `repetitions` windows of `window` consecutive steps. Amortized ms/step = mean over a
    window; plain step = median of the window's steps without a root computation; root step =
    median of those with one; root time = root step - plain step. Medians over the windows.
  f=1: two warm-up steps, then `steps` timed steps; their median.
  Peak memory (CUDA): torch.cuda.max_memory_allocated after reset_peak_memory_stats, reset after
    setup; it includes the harness's tensors (parameters, gradients, gradient sets), reported
    separately.
Every step is synchronized before and after (torch.cuda.synchronize on CUDA).

--memory measures no time: per root-inverse setting, two steps (gradient set i mod 3 copied into
.grad, as above; they compute no roots, which start at step N, but the state is allocated by
then), then the bytes of the optimizer's state: every tensor reachable from optimizer.state
(through dicts, lists, tuples and the reference's state dataclasses), each untyped storage counted
once, split by kind (state_kind) into a table of MB. Device: cpu unless --device says otherwise.

--no-symmetric-packing sets the preconditioner config's use_symmetric_packing=False (the
reference's default, True, stores the factor matrices and their inverse roots as packed upper
triangles, d(d+1)/2 elements instead of d*d), in every mode.

  python3 benchmarks/reference_transformer.py --reference-path DIR \\
      [--root-inv eigh,coupled-newton] [--one-group-per-tensor] [--device cuda|cpu] [--small] \\
      [--frequency 20] [--window 40] [--steps 5] [--repetitions 3] [--epsilon 1e-8] \\
      [--no-symmetric-packing] [--memory] [--threads T] [--json PATH]

Exits 1 when a setting failed (its row says why; the others are still measured).
DIR holds the reference's `distributed_shampoo` package (scripts/device_bundle.sh exports it into
.device/reference). It needs torch (and numpy, which the reference imports).
"""

import argparse
import collections
import dataclasses
import gc
import json
import logging
import math
import statistics
import sys
import time

GRADIENT_SETS = 3
SEED = 0
SMALL_DIVISOR = 8  # --small divides every dimension and max_preconditioner_dim by this
ROOT_INV_SETTINGS = ("eigh", "coupled-newton")
MEMORY_STEPS = 2  # --memory: steps taken before the state is counted
# --memory: the kinds of state, in table order; state_kind maps a state path to one of them.
STATE_KINDS = ("factor matrices", "inverse roots", "other Shampoo", "grafting (Adam) second moment",
               "filtered gradient", "momentum", "other")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="The reference DistributedShampoo on the transformer-like workload of issue 13."
    )
    parser.add_argument("--reference-path", default="",
                        help="folder holding the reference's distributed_shampoo package "
                             "(prepended to sys.path)")
    parser.add_argument("--root-inv", default="eigh",
                        help="comma-separated: eigh (the default EigenConfig), coupled-newton "
                             "(CoupledNewtonConfig with its defaults)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="device of the parameters (default: cuda when available)")
    parser.add_argument("--frequency", type=int, default=20,
                        help="precondition_frequency N of the amortized runs")
    parser.add_argument("--window", type=int, default=40,
                        help="timed consecutive steps per repetition at frequency N")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps at frequency 1 (0 skips frequency 1)")
    parser.add_argument("--repetitions", type=int, default=3,
                        help="timed windows at frequency N (medians over them)")
    parser.add_argument("--one-group-per-tensor", action="store_true",
                        help="21 param groups, group i with lr 1e-3*(1 + i/21)")
    parser.add_argument("--small", action="store_true",
                        help="every dimension and max_preconditioner_dim divided by 8 (CPU smoke "
                             "runs)")
    parser.add_argument("--workload", choices=("transformer", "mlp"), default="transformer",
                        help="the parameters: issue 13's transformer-like tensors (29.4M), or "
                             "bench_optimizer_step's MLP 784-2048-1024-512-10 (4.2M; issue 28)")
    parser.add_argument("--max-dim", type=int, default=0,
                        help="max_preconditioner_dim (0 = 1024, or 1024 / 8 with --small)")
    parser.add_argument("--epsilon", type=float, default=1e-8,
                        help="Shampoo's epsilon (issue 13: 1e-8)")
    parser.add_argument("--no-symmetric-packing", action="store_true",
                        help="use_symmetric_packing=False in the preconditioner config (full d x d "
                             "factor matrices and inverse roots; the reference's default packs "
                             "them)")
    parser.add_argument("--memory", action="store_true",
                        help=f"measure the optimizer state's bytes after {MEMORY_STEPS} steps "
                             "instead of timing (device cpu unless --device)")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads (0 = torch's default)")
    parser.add_argument("--json", default="", help="write the results as JSON to this file")
    parser.add_argument("--label", default="", help="free text copied into the JSON")
    args = parser.parse_args(argv)
    args.root_inv = [s for s in args.root_inv.split(",") if s]
    for name in args.root_inv:
        if name not in ROOT_INV_SETTINGS:
            parser.error(f"--root-inv: got '{name}', expected a comma-separated list of "
                         f"{', '.join(ROOT_INV_SETTINGS)}")
    if not args.root_inv:
        parser.error("--root-inv: got an empty list")
    if args.frequency < 2 or args.window < 1 or args.steps < 0 or args.repetitions < 1:
        parser.error("expected --frequency >= 2, --window >= 1, --steps >= 0, --repetitions >= 1")
    return args


def workload_shapes(small, workload="transformer"):
    if workload == "mlp":
        shapes = [(2048, 784), (2048,), (1024, 2048), (1024,), (512, 1024), (512,), (10, 512),
                  (10,)]
    else:
        layer = [(3072, 1024), (3072,), (1024, 1024), (1024,), (4096, 1024), (4096,),
                 (1024, 4096), (1024,), (1024,), (1024,)]
        shapes = [(4096, 1024)] + layer + layer
    if small:
        shapes = [tuple(max(1, d // SMALL_DIVISOR) for d in s) for s in shapes]
    return shapes


def max_dim(args):
    if args.max_dim > 0:
        return args.max_dim
    return 1024 // SMALL_DIVISOR if args.small else 1024


class Workload:
    """Parameters (with .grad allocated) and three gradient sets on the device."""

    def __init__(self, torch, device, small, workload="transformer"):
        self.torch = torch
        self.device = device
        self.shapes = workload_shapes(small, workload)
        self.params = [torch.nn.Parameter(p.to(device)) for p in self.draw_parameters()]
        # The generator continues after the parameters: the order bench_transformer draws in.
        self.gradient_sets = [[torch.randn(s).to(device) for s in self.shapes]
                              for _ in range(GRADIENT_SETS)]
        for p, g in zip(self.params, self.gradient_sets[0]):
            p.grad = g.clone()
        tensors = self.params + [p.grad for p in self.params]
        tensors += [g for gradient_set in self.gradient_sets for g in gradient_set]
        self.harness_bytes = sum(t.numel() * t.element_size() for t in tensors)
        # Equal to bench_transformer's when both drew the same numbers.
        self.checksum = sum(t.double().sum().item() for t in self.params)
        self.checksum += sum(g.double().sum().item() for s in self.gradient_sets for g in s)
        synchronize(torch, device)

    def draw_parameters(self):
        self.torch.manual_seed(SEED)
        return [self.torch.randn(s) * 0.02 for s in self.shapes]

    def reset_parameters(self):
        with self.torch.no_grad():
            for p, init in zip(self.params, self.draw_parameters()):
                p.copy_(init)

    def set_gradients(self, step):
        with self.torch.no_grad():
            for p, g in zip(self.params, self.gradient_sets[step % GRADIENT_SETS]):
                p.grad.copy_(g)


class WarningCounter(logging.Handler):
    """Counts the reference's log records of WARNING and above by the start of their message, and
    prints the first of each kind cut short: on a failed root computation the reference logs the
    whole factor matrix (megabytes of text for a 1024x1024 block)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.counts = collections.Counter()

    def emit(self, record):
        message = record.getMessage()
        kind = message[:72]
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            cut = message[:240] + (" ..." if len(message) > 240 else "")
            print(f"  reference {record.levelname.lower()}: {cut}", file=sys.stderr, flush=True)

    def take(self):
        counts, self.counts = dict(self.counts), collections.Counter()
        return counts


def install_warning_counter():
    counter = WarningCounter()
    logger = logging.getLogger("distributed_shampoo")
    logger.addHandler(counter)
    logger.propagate = False
    return counter


def synchronize(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_optimizer(ds, workload, root_inv, frequency, args):
    """The reference's DistributedShampoo with the workload's settings."""
    # Passed only when asked for: a reference without the option still runs the default.
    packing = {"use_symmetric_packing": False} if args.no_symmetric_packing else {}
    if packing and "use_symmetric_packing" not in {
            f.name for f in dataclasses.fields(ds.RootInvShampooPreconditionerConfig)}:
        sys.exit("reference_transformer: --no-symmetric-packing, but this reference's "
                 "RootInvShampooPreconditionerConfig has no use_symmetric_packing")
    if root_inv == "coupled-newton":
        preconditioner = ds.RootInvShampooPreconditionerConfig(
            amortized_computation_config=ds.CoupledNewtonConfig(), **packing)
    elif packing:
        # DefaultShampooConfig with the option: its default amortized config, DefaultEigenConfig.
        preconditioner = ds.RootInvShampooPreconditionerConfig(**packing)
    else:
        preconditioner = ds.DefaultShampooConfig  # eigendecomposition (DefaultEigenConfig)
    params = workload.params
    if args.one_group_per_tensor:
        n = len(params)
        params = [{"params": [p], "lr": 1e-3 * (1.0 + i / n)} for i, p in enumerate(params)]
    return ds.DistributedShampoo(
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        epsilon=args.epsilon,
        weight_decay=1e-5,
        weight_decay_type=ds.WeightDecayType.DECOUPLED,
        max_preconditioner_dim=max_dim(args),
        precondition_frequency=frequency,
        use_bias_correction=True,
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        preconditioner_config=preconditioner,
    )


def is_root_step(step, start, frequency):
    """Whether step `step` (counted from 1) computes roots: the reference's rule."""
    return step == start or (step > start and step % frequency == 0)


class Run:
    """One optimizer over the workload's parameters, reset to their initial values."""

    def __init__(self, ds, workload, root_inv, frequency, args):
        gc.collect()  # the previous run's optimizer, should cycles keep it alive, is freed first
        workload.reset_parameters()
        self.workload = workload
        self.optimizer = make_optimizer(ds, workload, root_inv, frequency, args)
        self.steps_taken = 0
        synchronize(workload.torch, workload.device)
        if workload.device.type == "cuda":
            workload.torch.cuda.reset_peak_memory_stats(workload.device)

    def timed_step(self):
        """Copies the step's gradient set into .grad (untimed), then times step()."""
        w = self.workload
        w.set_gradients(self.steps_taken)
        synchronize(w.torch, w.device)
        begin = time.perf_counter()
        self.optimizer.step()
        synchronize(w.torch, w.device)
        self.steps_taken += 1
        return (time.perf_counter() - begin) * 1e3

    def peak_bytes(self):
        w = self.workload
        if w.device.type != "cuda":
            return None
        return w.torch.cuda.max_memory_allocated(w.device)


def measure_amortized(ds, workload, root_inv, args):
    run = Run(ds, workload, root_inv, args.frequency, args)
    start = args.frequency  # start_preconditioning_step -1 resolves to precondition_frequency
    for _ in range(start):
        run.timed_step()
    result = {"window_mean_ms": [], "plain_median_ms": [], "root_step_ms": []}
    for r in range(args.repetitions):
        steps, plain = [], []
        for _ in range(args.window):
            root = is_root_step(run.steps_taken + 1, start, args.frequency)
            ms = run.timed_step()
            steps.append(ms)
            (result["root_step_ms"] if root else plain).append(ms)
        result["window_mean_ms"].append(statistics.fmean(steps))
        result["plain_median_ms"].append(statistics.median(plain) if plain else 0.0)
        print(f"  {root_inv} f={args.frequency} window {r + 1}/{args.repetitions}: "
              f"{result['window_mean_ms'][-1]:.2f} ms/step, plain step "
              f"{result['plain_median_ms'][-1]:.2f} ms, {len(steps) - len(plain)} root step(s)",
              flush=True)
    result["peak_bytes"] = run.peak_bytes()
    return result


def measure_every_step(ds, workload, root_inv, args):
    result = {"step_ms": [], "peak_bytes": None}
    if args.steps == 0:
        return result
    run = Run(ds, workload, root_inv, 1, args)
    for _ in range(2):
        run.timed_step()  # warm-up: allocations, the first roots
    result["step_ms"] = [run.timed_step() for _ in range(args.steps)]
    result["peak_bytes"] = run.peak_bytes()
    print(f"  {root_inv} f=1: median {statistics.median(result['step_ms']):.2f} ms/step over "
          f"{args.steps} steps [{', '.join(f'{ms:.1f}' for ms in result['step_ms'])}]", flush=True)
    return result


def measure(ds, workload, root_inv, args, counter):
    """Both runs of one setting; an exception (e.g. the reference's PreconditionerValueError on a
    non-finite root) ends the setting's runs and is reported in its row."""
    amortized = {"window_mean_ms": [], "plain_median_ms": [], "root_step_ms": [],
                 "peak_bytes": None}
    every_step = {"step_ms": [], "peak_bytes": None}
    error = None
    try:
        amortized = measure_amortized(ds, workload, root_inv, args)
        every_step = measure_every_step(ds, workload, root_inv, args)
    except Exception as e:  # noqa: BLE001 - any failure of the reference is reported, not fatal
        # The reference's messages go on with the whole factor matrix: keep their first sentence.
        message = str(e).split(" To mitigate")[0].split("\n")[0][:200]
        error = f"{type(e).__name__}: {message}"
        print(f"  {root_inv}: failed: {error}", flush=True)
    result = summarize(root_inv, amortized, every_step)
    result["error"] = error
    result["reference_warnings"] = counter.take()
    return result


def summarize(root_inv, amortized, every_step):
    def median(values):
        return statistics.median(values) if values else None

    peaks = [p for p in (amortized["peak_bytes"], every_step["peak_bytes"]) if p is not None]
    plain = median(amortized["plain_median_ms"])
    root_step = median(amortized["root_step_ms"])
    return {
        "name": root_inv,
        "amortized_ms": median(amortized["window_mean_ms"]),
        "plain_step_ms": plain,
        "root_step_ms": root_step,
        "root_ms": root_step - plain if root_step is not None and plain is not None else None,
        "every_step_ms": median(every_step["step_ms"]),
        "peak_bytes": max(peaks) if peaks else None,
        "peak_bytes_amortized": amortized["peak_bytes"],
        "peak_bytes_every_step": every_step["peak_bytes"],
        "per_window_ms": amortized["window_mean_ms"],
        "per_window_plain_ms": amortized["plain_median_ms"],
        "root_steps_ms": amortized["root_step_ms"],
        "every_steps_ms": every_step["step_ms"],
    }


def state_tensors(value, path=()):
    """(path, tensor) for every tensor reachable from `value`: through dicts, lists, tuples and
    dataclass instances (the reference keeps each block's Kronecker factors in a dataclass,
    e.g. RootInvShampooKroneckerFactorsState). A path is the keys, indices and attribute names on
    the way."""
    import torch

    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from state_tensors(item, path + (key,))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from state_tensors(item, path + (index,))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for name, item in vars(value).items():
            yield from state_tensors(item, path + (name,))


def state_kind(path):
    """The kind of a state tensor by the names on its path (the reference's state keys: per block
    'shampoo' with factor_matrices / inv_factor_matrices, 'adagrad' for the grafting's second
    moment, 'filtered_grad', 'momentum_buffer'; per parameter 'step' and the like)."""
    names = [p for p in path if isinstance(p, str)]
    if "inv_factor_matrices" in names:
        return "inverse roots"
    if "factor_matrices" in names:
        return "factor matrices"
    if "shampoo" in names:
        return "other Shampoo"
    if "adagrad" in names:
        return "grafting (Adam) second moment"
    if "filtered_grad" in names:
        return "filtered gradient"
    if "momentum_buffer" in names:
        return "momentum"
    return "other"


def factor_dim(shape):
    """The dimension d of a factor matrix of this shape: (d, d), or packed, (d(d+1)/2,)."""
    if len(shape) == 2:
        return shape[0]
    return (math.isqrt(1 + 8 * shape[0]) - 1) // 2


def measure_memory(ds, workload, root_inv, args):
    """The bytes of the optimizer's state after MEMORY_STEPS steps, by kind, each untyped storage
    counted once (attributed to the first path that reaches it)."""
    run = Run(ds, workload, root_inv, args.frequency, args)
    for _ in range(MEMORY_STEPS):
        run.timed_step()
    index = {id(p): i for i, p in enumerate(workload.params)}
    by_kind = dict.fromkeys(STATE_KINDS, 0)
    tensors = dict.fromkeys(STATE_KINDS, 0)
    seen = set()
    factors = collections.defaultdict(list)  # parameter index -> factor matrix shapes
    for param, param_state in run.optimizer.state.items():
        for path, tensor in state_tensors(param_state):
            kind = state_kind(path)
            if kind == "factor matrices":
                factors[index[id(param)]].append(tuple(tensor.shape))
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr(), storage.nbytes())
            if key in seen:
                continue
            seen.add(key)
            by_kind[kind] += storage.nbytes()
            tensors[kind] += 1
    packing = "off" if args.no_symmetric_packing else "on (reference default)"
    total = sum(by_kind.values())
    print(f"\nreference {root_inv}, symmetric packing {packing}: optimizer state after "
          f"{MEMORY_STEPS} steps\n\n| kind | storages | MB |\n|---|---|---|")
    for kind in STATE_KINDS:
        print(f"| {kind} | {tensors[kind]} | {megabytes(by_kind[kind])} |")
    print(f"| total | {sum(tensors.values())} | {megabytes(total)} |")
    dims = collections.Counter(factor_dim(s) for shapes in factors.values() for s in shapes)
    print("\nfactor matrices by dimension: "
          + ", ".join(f"{n} x d={d}" for d, n in sorted(dims.items()))
          + " (as many inverse roots)\nper parameter tensor (index, shape: factor matrix shapes):")
    for i, shape in enumerate(workload.shapes):
        shapes = factors.get(i, [])
        summary = ", ".join(f"{n} x {s}" for s, n in collections.Counter(shapes).items())
        print(f"  {i:2d} {shape}: {summary or 'none'}")
    print(f"MB = 1e6 bytes; each untyped storage counted once. Parameters: "
          f"{megabytes(sum(p.numel() * p.element_size() for p in workload.params))} MB.",
          flush=True)
    return {"name": root_inv, "symmetric_packing": not args.no_symmetric_packing,
            "steps": MEMORY_STEPS, "state_bytes": total, "state_bytes_by_kind": by_kind,
            "storages_by_kind": tensors,
            "factor_matrix_shapes": {str(i): [list(s) for s in factors.get(i, [])]
                                     for i in range(len(workload.shapes))}}


def megabytes(value):
    return "n/a" if value is None else f"{value / 1e6:.1f}"


def print_table(results, workload, args):
    f = args.frequency
    print(f"\n| solver | f={f} ms/step | f={f} plain step ms | root ms | f=1 ms/step | peak MB |\n"
          "|---|---|---|---|---|---|")

    def cell(value, digits):
        return "—" if value is None else f"{value:.{digits}f}"

    for r in results:
        if r["error"]:
            print(f"| reference {r['name']} | failed: {r['error'][:120]} | | | | |")
            continue
        print(f"| reference {r['name']} | {cell(r['amortized_ms'], 2)} | "
              f"{cell(r['plain_step_ms'], 2)} | {cell(r['root_ms'], 1)} | "
              f"{cell(r['every_step_ms'], 1)} | {megabytes(r['peak_bytes'])} |")
    groups = "21 param groups." if args.one_group_per_tensor else "One param group."
    print(f"\nf={f}: mean over a window of {args.window} steps (median of {args.repetitions} "
          "windows); plain step: median of the steps without roots; root = step with roots - "
          "plain step. Peak MB (1e6 bytes) includes the harness's "
          f"{megabytes(workload.harness_bytes)} MB of parameters, gradients and gradient sets. "
          f"{groups}")


def results_json(results, workload, args, torch):
    return {
        "benchmark": "reference_transformer",
        "label": args.label,
        "torch": torch.__version__,
        "device": str(workload.device),
        "device_name": (torch.cuda.get_device_name(workload.device)
                        if workload.device.type == "cuda" else None),
        "parameters": sum(p.numel() for p in workload.params),
        "parameter_tensors": len(workload.params),
        "harness_bytes": workload.harness_bytes,
        "workload_checksum": workload.checksum,
        "settings": {
            "frequency": args.frequency, "window": args.window,
            "repetitions": args.repetitions, "every_step_steps": args.steps,
            "one_group_per_tensor": args.one_group_per_tensor, "small": args.small,
            "workload": args.workload, "max_preconditioner_dim": max_dim(args),
            "epsilon": args.epsilon,
            "symmetric_packing": not args.no_symmetric_packing, "memory": args.memory,
            "shapes": [list(s) for s in workload.shapes],
        },
        "solvers": results,
    }


def main(argv):
    args = parse_args(argv)
    if args.reference_path:
        sys.path.insert(0, args.reference_path)
    import torch
    import distributed_shampoo as ds

    if args.threads > 0:
        torch.set_num_threads(args.threads)

    counter = install_warning_counter()

    device_name = args.device or ("cuda" if torch.cuda.is_available() and not args.memory
                                  else "cpu")
    if device_name == "cuda" and not torch.cuda.is_available():
        sys.exit("reference_transformer: --device cuda, but no CUDA device is available")
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    workload = Workload(torch, device, args.small, args.workload)
    print(f"reference_transformer: {args.workload} workload, max_preconditioner_dim "
          f"{max_dim(args)}, {sum(p.numel() for p in workload.params)} parameters in "
          f"{len(workload.params)} tensors{' (--small: dimensions / 8)' if args.small else ''}, "
          f"device {device}, torch {torch.__version__}, epsilon {args.epsilon:g}, reference from "
          f"{ds.__file__}\n"
          f"  harness tensors (parameters, gradients, {GRADIENT_SETS} gradient sets): "
          f"{megabytes(workload.harness_bytes)} MB", flush=True)
    if args.memory:
        results = []
        for root_inv in args.root_inv:
            results.append(measure_memory(ds, workload, root_inv, args))
            results[-1].update(error=None, reference_warnings=counter.take())
    else:
        results = [measure(ds, workload, root_inv, args, counter) for root_inv in args.root_inv]
        print_table(results, workload, args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results_json(results, workload, args, torch), out, indent=2)
            out.write("\n")
        print(f"\nwrote {args.json}")
    if any(r["error"] for r in results):
        sys.exit(1)  # as bench_transformer: a failed setting fails the run (its row says why)


if __name__ == "__main__":
    main(sys.argv[1:])
