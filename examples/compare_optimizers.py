#!/usr/bin/env python3
"""Compares Distributed Shampoo with Adam, AdamW and SGD on one workload, one budget.

    compare_optimizers.py --trainer BIN --out DIR --device cpu|cuda [--workload W] [options]

`make compare` runs this through <build>/examples/run_compare.sh, which knows the trainer, the
torchrun launcher and the folder holding matplotlib, once per workload. The workloads, with
examples/cifar10_trainer:
  convnet      the reference's ConvNet on Fashion-MNIST, classification; metric: test accuracy
               (higher is better)
  autoencoder  the deep autoencoder (784-1000-500-250-30, mirrored, sigmoid units) on
               Fashion-MNIST, on which second-order methods are known to win; metric: the test
               reconstruction loss (binary cross-entropy in nats per image, lower is better)
  lm           the word-level LSTM language model (tied embedding of 128, one LSTM layer,
               LayerNorm) on the Penn Treebank, sequences of 35 tokens; metric: the validation
               perplexity (exp of the mean token cross-entropy over the validation set, lower is
               better)
For every optimizer and every learning rate of its grid (the same grid size for every optimizer)
and every seed, it trains the workload's model with the same epochs, global batch, lr schedule,
weight decay and seeds for all; only the optimizer, its lr and its own constants (Adam's epsilon,
SGD's momentum, Shampoo's settings from the README) differ. Then it writes (STEM: compare for
convnet, compare_autoencoder for autoencoder, compare_lm for lm)

    DIR/STEM.csv   one row per run and epoch: test accuracy and loss, cumulative and per-epoch
                   seconds
    DIR/STEM.png   the metric against steps and against seconds, best lr of each optimizer
    DIR/STEM.md    the table printed at the end, with a caption that states the budget

and keeps every run's metrics and log in DIR/runs/[autoencoder/|lm/]<optimizer>-lr<lr>-seed<seed>/.
The best lr of an optimizer is the one with the best final metric (mean over the seeds). While it
is the largest (smallest) rate of its grid, the grid is widened by the rate times (divided by)
--widen-factor, at most --widen times; a best lr still at an edge is marked "(edge)" in the
table. Seconds are the trainer's own epoch times (training plus the evaluation after each epoch;
process start-up and data loading are not counted).

Budgets: on cuda the full one; on cpu a reduced one (convnet: 3 epochs, 2 ranks, about 12
minutes on 2 cores; autoencoder: 10 epochs on 20000 examples, 2 ranks, about 14 minutes; lm: see
LM_REDUCED_BUDGET). --budget full|reduced picks one on any device; flags override either.
"""

import argparse
import csv
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

OPTIMIZERS = ("shampoo", "adam", "adamw", "sgd")

# Flags of each optimizer besides --lr. Shampoo: the README's recommended settings, as `make demo`
# uses them (Adam grafting, roots every 50 steps, blocks of at most 128 for the CPU).
OPTIMIZER_FLAGS = {
    "shampoo": ["--betas", "0.9,0.999", "--epsilon", "1e-12", "--grafting", "adam",
                "--grafting-beta2", "0.999", "--grafting-epsilon", "1e-8",
                "--precondition-frequency", "50", "--max-preconditioner-dim", "128"],
    "adam": ["--betas", "0.9,0.999", "--epsilon", "1e-8"],
    "adamw": ["--betas", "0.9,0.999", "--epsilon", "1e-8"],
    "sgd": ["--momentum", "0.9"],
}
OPTIMIZER_SUMMARY = {
    "shampoo": "betas 0.9,0.999, epsilon 1e-12, Adam grafting (epsilon 1e-8), roots every 50 "
               "steps, blocks <= 128, decoupled weight decay",
    "adam": "betas 0.9,0.999, epsilon 1e-8, L2 weight decay",
    "adamw": "betas 0.9,0.999, epsilon 1e-8, decoupled weight decay",
    "sgd": "momentum 0.9, L2 weight decay",
}
# Three rates per optimizer around the value usually recommended for it (SGD with momentum 0.9
# on this model: 0.1 and 0.3 reached 0.44 and 0.32 test accuracy in a one-epoch probe, 0.01 0.80).
DEFAULT_GRID = {
    "shampoo": [0.003, 0.001, 0.0003],
    "adam": [0.003, 0.001, 0.0003],
    "adamw": [0.003, 0.001, 0.0003],
    "sgd": [0.03, 0.01, 0.003],
}
# Settings shared by every run.
LR_SCHEDULE = "cosine"
# Budgets: (epochs, training examples, 0 = all), seeds, ranks.
FULL_BUDGET = {"epochs": 10, "limit_train": 0, "seeds": [2022], "ranks": 1}
REDUCED_BUDGET = {"epochs": 3, "limit_train": 0, "seeds": [2022], "ranks": 2}
# The deep autoencoder's rates: SGD with momentum needs larger ones on its sigmoid layers.
AUTOENCODER_GRID = {
    "shampoo": [0.003, 0.001, 0.0003],
    "adam": [0.003, 0.001, 0.0003],
    "adamw": [0.003, 0.001, 0.0003],
    "sgd": [0.1, 0.03, 0.01],
}

# The language model's rates: Adam's usual range for small LSTM language models; SGD with
# momentum 0.9 on its tied embedding needs rates near 1.
LM_GRID = {
    "shampoo": [0.01, 0.003, 0.001],
    "adam": [0.01, 0.003, 0.001],
    "adamw": [0.01, 0.003, 0.001],
    "sgd": [1.0, 0.3, 0.1],
}
# The language model's budgets, in sequences of 35 tokens (26559 in PTB's training set), global
# batch 32.
LM_FULL_BUDGET = {"epochs": 10, "limit_train": 0, "seeds": [2022], "ranks": 1}
LM_REDUCED_BUDGET = {"epochs": 4, "limit_train": 3200, "seeds": [2022], "ranks": 2}

# The workloads (--workload). metric: the key of an epoch's values that decides the best lr and
# the targets (eval.csv's column, or perplexity = exp(test_loss)); higher: whether a larger value
# is better; target: the fixed target of the table; batch: the default global batch; evaluated:
# what the metric is measured on; examples: what a training example is; files: the stem of the
# CSV, PNG and table; runs: the folder of the runs under DIR/runs.
WORKLOADS = {
    "convnet": {
        "title": "ConvNet on Fashion-MNIST", "model": "convnet", "dataset": "fashion-mnist",
        "metric": "test_accuracy", "metric_name": "test accuracy", "higher": True,
        "batch": 256, "evaluated": "10000 test images", "examples": "training examples",
        "target": 0.90, "grid": DEFAULT_GRID, "weight_decay": "1e-4",
        "full": FULL_BUDGET, "reduced": REDUCED_BUDGET, "files": "compare", "runs": "",
    },
    "autoencoder": {
        "title": "Deep autoencoder (784-1000-500-250-30, mirrored, sigmoid) on Fashion-MNIST",
        "model": "autoencoder", "dataset": "fashion-mnist",
        "batch": 256, "evaluated": "10000 test images", "examples": "training examples",
        "metric": "test_loss", "metric_name": "test reconstruction loss (nats per image)",
        "higher": False, "target": 240.0, "grid": AUTOENCODER_GRID, "weight_decay": "1e-5",
        "full": {"epochs": 20, "limit_train": 0, "seeds": [2022], "ranks": 1},
        "reduced": {"epochs": 10, "limit_train": 20000, "seeds": [2022], "ranks": 2},
        "files": "compare_autoencoder", "runs": "autoencoder",
    },
    "lm": {
        "title": "LSTM language model (tied embedding 128, 1 layer, LayerNorm) on the Penn Treebank",
        "model": "lm", "dataset": "ptb",
        "batch": 32, "evaluated": "the 73760 tokens of the validation set",
        "examples": "training sequences of 35 tokens",
        "metric": "perplexity", "metric_name": "validation perplexity",
        "higher": False, "target": 300.0, "grid": LM_GRID, "weight_decay": "1e-5",
        "full": LM_FULL_BUDGET, "reduced": LM_REDUCED_BUDGET,
        "files": "compare_lm", "runs": "lm",
    },
}

CSV_COLUMNS = ["optimizer", "lr", "seed", "epoch", "test_accuracy", "test_loss",
               "cumulative_seconds", "epoch_seconds", "device", "ranks", "train_examples",
               "best_lr"]


class UsageError(Exception):
    """Bad input: reported as one line naming the flag, exit code 2."""


def metric(args, point):
    """The workload's metric of an epoch (or a curve point)."""
    return point[args.workload["metric"]]


def best_of(args, values, key=lambda value: value):
    """The best of `values` by the workload's metric (the largest, or the smallest for a loss)."""
    return (max if args.workload["higher"] else min)(values, key=key)


def reaches(args, value, target):
    return value >= target if args.workload["higher"] else value <= target


def parse_rates(text, what):
    """'0.003,0.001' -> [0.003, 0.001]; positive, finite, distinct."""
    rates = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            rate = float(item)
        except ValueError:
            raise UsageError(f"{what}: got '{item}', expected a number such as 0.001") from None
        if not (math.isfinite(rate) and rate > 0):
            raise UsageError(f"{what}: got {item}, expected a learning rate > 0")
        if rate in rates:
            raise UsageError(f"{what}: {item} appears twice")
        rates.append(rate)
    if not rates:
        raise UsageError(f"{what}: got '{text}', an empty grid; expected at least one lr")
    return rates


def parse_grid(optimizers, overrides, defaults):
    """The lr grid of every optimizer: the workload's, replaced by --lrs OPTIMIZER=a,b,c."""
    grid = {name: list(defaults[name]) for name in optimizers}
    for override in overrides:
        name, sep, rates = override.partition("=")
        name = name.strip()
        if not sep:
            raise UsageError(f"--lrs: got '{override}', expected OPTIMIZER=lr1,lr2,...")
        if name not in OPTIMIZERS:
            raise UsageError(f"--lrs: unknown optimizer '{name}', expected one of "
                             f"{', '.join(OPTIMIZERS)}")
        if name not in grid:
            raise UsageError(f"--lrs: '{name}' is not in --optimizers ({','.join(optimizers)})")
        grid[name] = parse_rates(rates, f"--lrs {name}")
    sizes = {name: len(rates) for name, rates in grid.items()}
    if len(set(sizes.values())) != 1:
        listed = ", ".join(f"{name} {size}" for name, size in sizes.items())
        raise UsageError(f"--lrs: every optimizer needs the same grid size; got {listed}")
    return grid


def parse_optimizers(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UsageError(f"--optimizers: got '{text}', expected a list such as shampoo,adam")
    for name in names:
        if name not in OPTIMIZERS:
            raise UsageError(f"--optimizers: unknown optimizer '{name}', expected any of "
                             f"{', '.join(OPTIMIZERS)}")
    if len(set(names)) != len(names):
        raise UsageError(f"--optimizers: got '{text}', an optimizer listed twice")
    return names


def parse_seeds(text):
    try:
        seeds = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"--seeds: got '{text}', expected integers such as 2022,2023") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds: got '{text}', expected distinct integers such as 2022,2023")
    return seeds


def resolve(args):
    """Checks the flags and fills in the budget of the device; raises UsageError."""
    if args.device not in ("cpu", "cuda"):
        raise UsageError(f"--device: got '{args.device}', expected cpu or cuda")
    if args.workload not in WORKLOADS:
        raise UsageError(f"--workload: got '{args.workload}', expected one of "
                         f"{', '.join(WORKLOADS)}")
    args.workload = WORKLOADS[args.workload]
    args.optimizers = parse_optimizers(args.optimizers)
    args.grid = parse_grid(args.optimizers, args.lrs, args.workload["grid"])
    if args.budget not in (None, "full", "reduced"):
        raise UsageError(f"--budget: got '{args.budget}', expected full or reduced")
    full = args.budget == "full" or (args.budget is None and args.device == "cuda")
    budget = args.workload["full" if full else "reduced"]
    args.budget_name = "full" if full else "reduced (CPU)"
    for key in ("epochs", "limit_train", "ranks"):
        if getattr(args, key) is None:
            setattr(args, key, budget[key])
    args.seeds = parse_seeds(args.seeds) if args.seeds is not None else list(budget["seeds"])
    if args.epochs < 1:
        raise UsageError(f"--epochs: got {args.epochs}, expected >= 1")
    if args.limit_train < 0:
        raise UsageError(f"--limit-train: got {args.limit_train}, expected >= 0 (0 = all)")
    if args.ranks < 1:
        raise UsageError(f"--ranks: got {args.ranks}, expected >= 1")
    if args.batch_size is None:
        args.batch_size = args.workload["batch"]
    if args.batch_size < 1 or args.batch_size % args.ranks:
        raise UsageError(f"--batch-size: got {args.batch_size}, expected a positive multiple "
                         f"of --ranks ({args.ranks})")
    if args.widen < 0:
        raise UsageError(f"--widen: got {args.widen}, expected >= 0")
    if not (math.isfinite(args.widen_factor) and args.widen_factor > 1):
        raise UsageError(f"--widen-factor: got {args.widen_factor:g}, expected a number > 1")
    if args.target is None:
        args.target = args.workload["target"]
    if args.workload["higher"] and not 0 < args.target <= 1:
        raise UsageError(f"--target: got {args.target}, expected an accuracy in (0, 1]")
    if not args.workload["higher"] and not (math.isfinite(args.target) and args.target > 0):
        raise UsageError(f"--target: got {args.target}, expected a loss > 0")
    if not os.access(args.trainer, os.X_OK):
        raise UsageError(f"--trainer: {args.trainer} is not an executable (run make build)")
    if args.ranks > 1 and not args.torchrun:
        raise UsageError(f"--ranks {args.ranks} needs torchrun (--torchrun; "
                         "scripts/install_deps.sh installs one)")


def import_pyplot():
    """matplotlib's pyplot on the file-only backend; exits with a clear message when absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        sys.exit(f"compare_optimizers.py: matplotlib is not importable ({error}); run "
                 "scripts/install_deps.sh and set PYTHONPATH to the folder it prints (see "
                 "examples/README.md), or pass --no-plot")
    return plt


def format_lr(rate):
    return f"{rate:g}"


def describe_budget(budget, what="training examples"):
    examples = f"the first {budget['limit_train']}" if budget["limit_train"] else "all"
    return (f"{budget['epochs']} epochs on {examples} {what}, {budget['ranks']} "
            f"rank(s), seed(s) {','.join(map(str, budget['seeds']))}")


def run_name(optimizer, rate, seed):
    return f"{optimizer}-lr{format_lr(rate)}-seed{seed}"


def output_path(args, suffix):
    """DIR/<the workload's file stem>.<suffix>."""
    return os.path.join(args.out, f"{args.workload['files']}.{suffix}")


def trainer_command(args, optimizer, rate, seed, run_dir):
    flags = ["--device", args.device, "--dataset", args.workload["dataset"],
             "--model", args.workload["model"],
             "--optimizer", optimizer, "--lr", format_lr(rate), *OPTIMIZER_FLAGS[optimizer],
             "--epochs", str(args.epochs), "--local-batch-size", str(args.batch_size // args.ranks),
             "--limit-train", str(args.limit_train), "--seed", str(seed),
             "--lr-schedule", LR_SCHEDULE, "--weight-decay", args.workload["weight_decay"],
             "--bias-weight-decay", "0", "--window-size", "50", "--log-every", "100",
             "--progress", "off", "--metrics-dir", run_dir]
    if args.data_dir:
        flags += ["--data-dir", args.data_dir]
    if args.ranks == 1:
        return [args.trainer, *flags]
    return [args.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(args.ranks),
            args.trainer, *flags]


def read_run(run_dir, log_path):
    """The epochs of one finished run (eval.csv) and its training-set size (from its log)."""
    with open(os.path.join(run_dir, "eval.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    epochs, cumulative = [], 0.0
    for row in rows:
        cumulative += float(row["epoch_seconds"])
        test_loss = float(row["test_loss"])
        # The language model's perplexity; for the others exp of their test loss, not used.
        perplexity = math.exp(test_loss) if test_loss < 700 else math.inf
        epochs.append({"epoch": int(row["epoch"]), "test_accuracy": float(row["test_accuracy"]),
                       "test_loss": test_loss, "perplexity": perplexity,
                       "epoch_seconds": float(row["epoch_seconds"]),
                       "cumulative_seconds": cumulative, "device": row["device"]})
    with open(log_path, errors="replace") as f:
        log = f.read()
    match = re.search(r"Data: .*?: (\d+) training examples \(of (\d+)\)", log)
    train_examples = (int(match.group(1)), int(match.group(2))) if match else None
    match = re.search(r"(\d+) iterations per epoch", log)
    if match is None:
        raise ValueError(f"{log_path} does not state the iterations per epoch")
    for e in epochs:
        e["step"] = e["epoch"] * int(match.group(1))
    return epochs, train_examples


def reuse_run(prefix, command, log_path):
    """--report-only: checks that the run in log_path was made with exactly this command."""
    try:
        with open(log_path, errors="replace") as f:
            recorded = f.readline().rstrip("\n")
    except OSError as error:
        sys.exit(f"{prefix}: --report-only, but no finished run to read ({error})")
    if recorded != "+ " + " ".join(command):
        sys.exit(f"{prefix}: --report-only, but {log_path} was run with other settings:\n"
                 f"  {recorded}\nexpected\n  + {' '.join(command)}")


def run_one(args, optimizer, rate, seed, prefix, env):
    """Trains (or, with --report-only, reads) one run; returns its epochs."""
    run_dir = os.path.join(args.out, "runs", args.workload["runs"], run_name(optimizer, rate, seed))
    log_path = os.path.join(run_dir, "trainer.log")
    command = trainer_command(args, optimizer, rate, seed, run_dir)
    start = time.monotonic()
    if args.report_only:
        reuse_run(prefix, command, log_path)
        code = 0
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        print(f"{prefix}: started", flush=True)
        with open(log_path, "w") as log:
            log.write("+ " + " ".join(command) + "\n")
            log.flush()
            code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.monotonic() - start
    if code != 0:
        with open(log_path, errors="replace") as f:
            tail = f.readlines()[-15:]
        sys.exit(f"{prefix}: the trainer failed (exit code {code}) after {seconds:.1f} s; "
                 f"last lines of {log_path}:\n{''.join(tail)}")
    try:
        epochs, train_examples = read_run(run_dir, log_path)
    except (OSError, KeyError, ValueError) as error:
        sys.exit(f"{prefix}: cannot read the run's metrics in {run_dir} ({error})")
    if len(epochs) != args.epochs:
        sys.exit(f"{prefix}: {run_dir}/eval.csv has {len(epochs)} epochs, expected {args.epochs}")
    args.train_examples = args.train_examples or train_examples
    best = best_of(args, [metric(args, e) for e in epochs])
    how = "read" if args.report_only else f"finished, {seconds:.1f} s"
    print(f"{prefix}: {how}, best {args.workload['metric_name']} {best:.4f} (final "
          f"{metric(args, epochs[-1]):.4f})", flush=True)
    return epochs


def final_values(args, results, optimizer, rates):
    """lr -> the final value of the workload's metric, the mean over the seeds."""
    return {rate: statistics.fmean(metric(args, results[(optimizer, rate, seed)][-1])
                                   for seed in args.seeds) for rate in rates}


def grid_edge(rates, best):
    """'largest' or 'smallest' when `best` is at that edge of `rates`, else None (one rate: the
    largest)."""
    if best == max(rates):
        return "largest"
    if best == min(rates):
        return "smallest"
    return None


def widened_rate(args, optimizer, results):
    """The rate that widens the grid of `optimizer` past the edge its best lr is at, or None
    (best inside, one rate, or --widen times widened already)."""
    rates = args.grid[optimizer]
    if len(rates) < 2 or args.widened[optimizer] >= args.widen:
        return None
    finals = final_values(args, results, optimizer, rates)
    best = best_of(args, rates, key=lambda rate: finals[rate])
    edge = grid_edge(rates, best)
    if edge is None:
        return None
    rate = float(f"{best * args.widen_factor if edge == 'largest' else best / args.widen_factor:.3g}")
    return None if rate in rates else rate


def train_all(args):
    """Runs every (optimizer, lr, seed), then widens each grid whose best lr (best final value of
    the workload's metric, mean over the seeds) is at an edge, by one rate × or ÷ --widen-factor, at most
    --widen times; returns {(optimizer, lr, seed): epochs}. With --report-only, reads the runs
    that an identical earlier invocation left in DIR/runs (the same widening follows from them)."""
    args.initial_grid = {o: list(rates) for o, rates in args.grid.items()}
    args.widened = {o: 0 for o in args.optimizers}
    results = {}
    args.train_examples = None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [(o, r, s) for o in args.optimizers for r in args.grid[o] for s in args.seeds]
    done = 0
    while runs:
        planned = done + len(runs)
        for optimizer, rate, seed in runs:
            done += 1
            prefix = (f"[{done:>{len(str(planned))}}/{planned}] {optimizer} lr {format_lr(rate)} "
                      f"seed {seed}")
            results[(optimizer, rate, seed)] = run_one(args, optimizer, rate, seed, prefix, env)
        runs = []
        for optimizer in args.optimizers:
            rate = widened_rate(args, optimizer, results)
            if rate is None:
                continue
            print(f"{optimizer}: the best lr is at an edge of its grid; widening it with "
                  f"{format_lr(rate)}", flush=True)
            args.grid[optimizer].append(rate)
            args.widened[optimizer] += 1
            runs += [(optimizer, rate, seed) for seed in args.seeds]
    return results


def mean_curve(args, results, optimizer, rate):
    """Per epoch: the workload's metric and cumulative seconds, the means over the seeds."""
    runs = [results[(optimizer, rate, seed)] for seed in args.seeds]
    key = args.workload["metric"]
    return [{"epoch": runs[0][i]["epoch"], "step": runs[0][i]["step"],
             key: statistics.fmean(run[i][key] for run in runs),
             "cumulative_seconds": statistics.fmean(run[i]["cumulative_seconds"] for run in runs)}
            for i in range(len(runs[0]))]


def summarize(args, results):
    """One row per optimizer for its best lr (best final value of the metric, mean over seeds)."""
    summary = []
    for optimizer in args.optimizers:
        finals = final_values(args, results, optimizer, args.grid[optimizer])
        best_rate = best_of(args, args.grid[optimizer], key=lambda rate: finals[rate])
        curve = mean_curve(args, results, optimizer, best_rate)
        reached = next((p for p in curve if reaches(args, metric(args, p), args.target)), None)
        best_point = best_of(args, curve, key=lambda point: metric(args, point))
        epoch_seconds = [e["epoch_seconds"] for seed in args.seeds
                         for e in results[(optimizer, best_rate, seed)]]
        summary.append({"optimizer": optimizer, "lr": best_rate, "curve": curve,
                        "final": metric(args, curve[-1]), "best": best_point,
                        "reached": reached, "epoch_seconds": statistics.median(epoch_seconds),
                        "finals": finals, "edge": grid_edge(args.grid[optimizer], best_rate)})
    # The second target: the final value of Adam's best run, when Adam ran.
    adam = next((row for row in summary if row["optimizer"] == "adam"), None)
    args.adam_target = adam["final"] if adam else None
    for row in summary:
        row["reached_adam"] = None if adam is None else next(
            (p for p in row["curve"] if reaches(args, metric(args, p), args.adam_target)), None)
    return summary


def write_csv(path, args, results, summary):
    best_rates = {row["optimizer"]: row["lr"] for row in summary}
    examples = args.train_examples[0] if args.train_examples else ""
    # The language model's metric, exp(test_loss), as a column of its own (after the others).
    perplexity = args.workload["metric"] == "perplexity"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS + (["perplexity"] if perplexity else []))
        for (optimizer, rate, seed), epochs in results.items():
            for e in epochs:
                writer.writerow([optimizer, format_lr(rate), seed, e["epoch"],
                                 f"{e['test_accuracy']:.6g}", f"{e['test_loss']:.6g}",
                                 f"{e['cumulative_seconds']:.3f}", f"{e['epoch_seconds']:.3f}",
                                 e["device"], args.ranks, examples,
                                 int(best_rates[optimizer] == rate)]
                                + ([f"{e['perplexity']:.6g}"] if perplexity else []))


def caption(args, results):
    devices = sorted({e["device"] for epochs in results.values() for e in epochs})
    examples = args.workload["examples"]
    if args.train_examples:
        used, total = args.train_examples
        data = (f"all {total} {examples}" if used == total
                else f"a subset of {used} of the {total} {examples}")
    else:
        data = (f"the first {args.limit_train} {examples}" if args.limit_train
                else f"all {examples}")
    grid_size = len(next(iter(args.initial_grid.values())))
    widened = [f"{o} {', '.join(map(format_lr, args.grid[o][len(args.initial_grid[o]):]))}"
               for o in args.optimizers if len(args.grid[o]) > len(args.initial_grid[o])]
    factor = f"{args.widen_factor:g}"
    widening = (f", widened while the best lr was at an edge (×{factor} or ÷{factor}, at most "
                f"{args.widen} time(s): {'; '.join(widened) if widened else 'none needed'})"
                if args.widen else "")
    seeds = ",".join(str(seed) for seed in args.seeds)
    rank_text = (f"{args.ranks} ranks (torchrun, 1 thread each)" if args.ranks > 1
                 else "1 process (1 thread)" if args.device == "cpu" else "1 process")
    w = args.workload
    best = "highest" if w["higher"] else "lowest"
    reach = "reaches" if w["higher"] else "is at or below"
    return (f"{w['title']}, {args.budget_name} budget, the same for every optimizer: "
            f"{args.epochs} epoch(s) on {data}, global batch {args.batch_size}, {LR_SCHEDULE} lr "
            f"schedule, weight decay {w['weight_decay']} (none on the bias), seed(s) {seeds}; a "
            f"grid of {grid_size} learning rate(s) per optimizer{widening}; device "
            f"{', '.join(devices)}, "
            f"{rank_text}. Best lr = the {best} final {w['metric_name']} ({w['evaluated']}"
            f"{', mean over the seeds' if len(args.seeds) > 1 else ''}); seconds are the "
            f"trainer's epoch times, training plus the evaluation after each epoch, "
            f"start-up excluded. Steps and seconds to a target: at the first epoch whose "
            f"{w['metric_name']} {reach} it (evaluated after each epoch; steps = epochs × "
            f"{iterations_per_epoch(results)} iterations per epoch); the second target is the "
            f"final value of Adam's best run{adam_target_text(args)}. A best lr marked (edge) is "
            f"the largest or smallest of its grid: the grid does not bracket the best, and a "
            f"wider one could do better.")


def iterations_per_epoch(results):
    epochs = next(iter(results.values()))
    return epochs[0]["step"] // epochs[0]["epoch"]


def adam_target_text(args):
    if args.adam_target is None:
        return " (not measured: Adam did not run)"
    return f", {args.adam_target:.4f}"


def to_target(point):
    """(steps, seconds) cells of the first point reaching a target, or 'not reached'."""
    if point is None:
        return "not reached", "not reached"
    return str(point["step"]), f"{point['cumulative_seconds']:.1f}"


def markdown_table(args, results, summary):
    target = f"{args.target:g}"
    adam_target = "—" if args.adam_target is None else f"{args.adam_target:.4f}"
    name = args.workload["metric_name"]
    short = name.split(" (")[0]  # without the unit
    lines = [f"{caption(args, results)}", "",
             f"| optimizer | best lr | final {name} | best {short} (epoch) | "
             f"steps to {target} | seconds to {target} | steps to Adam's {adam_target} | "
             f"seconds to Adam's {adam_target} | steps / Adam's | seconds per epoch (median) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    adam = next((row for row in summary if row["optimizer"] == "adam"), None)
    for row in summary:
        steps_to, seconds_to = to_target(row["reached"])
        if args.adam_target is None:
            steps_adam, seconds_adam, ratio = "—", "—", "—"
        else:
            steps_adam, seconds_adam = to_target(row["reached_adam"])
            ratio = (f"{row['reached_adam']['step'] / adam['reached_adam']['step']:.2f}"
                     if row["reached_adam"] else "not reached")
        best_lr = format_lr(row["lr"]) + (" (edge)" if row["edge"] else "")
        lines.append(
            f"| {row['optimizer']} | {best_lr} | {row['final']:.4f} | "
            f"{metric(args, row['best']):.4f} ({row['best']['epoch']}) | {steps_to} | "
            f"{seconds_to} | {steps_adam} | {seconds_adam} | {ratio} | "
            f"{row['epoch_seconds']:.1f} |")
    grid_size = max(len(rates) for rates in args.grid.values())
    lines += ["", f"Final {short} of every run of the grid, largest lr first (lr: {short}):",
              "", "| optimizer | " + " | ".join(f"lr {i + 1}" for i in range(grid_size)) + " |",
              "|---|" + "---:|" * grid_size]
    for row in summary:
        rates = sorted(args.grid[row["optimizer"]], reverse=True)
        cells = [f"{format_lr(rate)}: {row['finals'][rate]:.4f}" for rate in rates]
        cells += [""] * (grid_size - len(cells))
        lines.append(f"| {row['optimizer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path, args, summary, plt):
    figure, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for color, row in enumerate(summary):
        label = f"{row['optimizer']} (lr {format_lr(row['lr'])})"
        epochs = [p["step"] for p in row["curve"]]
        values = [metric(args, p) for p in row["curve"]]
        seconds = [p["cumulative_seconds"] for p in row["curve"]]
        # Markers and dashes of their own, so that coinciding curves (Adam and AdamW with little
        # weight decay) both stay visible.
        style = {"color": f"C{color}", "marker": "os^D"[color % 4], "label": label,
                 "markersize": 7 - color, "linestyle": ("-", "--", ":", "-.")[color % 4]}
        by_epoch.plot(epochs, values, **style)
        by_time.plot(seconds, values, **style)
    for axes, xlabel in ((by_epoch, "steps (evaluated after each epoch)"),
                         (by_time, "wall-clock seconds (cumulative)")):
        axes.axhline(args.target, color="0.5", linestyle="--", linewidth=0.8,
                     label=f"target {args.target:g}")
        if args.adam_target is not None:
            axes.axhline(args.adam_target, color="0.3", linestyle=":", linewidth=0.8,
                         label=f"Adam's final {args.adam_target:.4f}")
        low, high = axes.get_ylim()
        if args.workload["higher"]:
            axes.set_ylim(top=max(high, args.target + 0.005))  # the target in view
        else:
            axes.set_ylim(bottom=min(low, args.target * 0.99))
        axes.set_xlabel(xlabel)
        axes.set_ylabel(args.workload["metric_name"])
        axes.grid(True, alpha=0.3)
    by_epoch.legend(fontsize=8)
    short = args.workload["metric_name"].split(" (")[0]
    by_epoch.set_title(f"{short} against steps (best lr of each optimizer)", fontsize=10)
    by_time.set_xlim(left=0)
    by_time.set_title(f"{short} against time", fontsize=10)
    where = args.device if args.ranks == 1 else f"{args.device}, {args.ranks} ranks"
    examples = (f", {args.train_examples[0]} {args.workload['examples']}" if args.train_examples
                else "")
    figure.suptitle(f"{args.workload['title']}, {args.epochs} epoch(s){examples}, {where}",
                    fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="; ".join(
            f"{name}: cpu -> the reduced budget, {describe_budget(w['reduced'], w['examples'])}; "
            f"cuda -> the full budget, {describe_budget(w['full'], w['examples'])}; lr grids "
            + ", ".join(f"{o} {','.join(map(format_lr, r))}" for o, r in w["grid"].items())
            for name, w in WORKLOADS.items()))
    parser.add_argument("--workload", default="convnet",
                        help="convnet (classification, test accuracy), autoencoder (the deep "
                             "autoencoder, test reconstruction loss) or lm (the LSTM language "
                             "model on the Penn Treebank, validation perplexity); default convnet")
    parser.add_argument("--trainer", required=True, help="the cifar10_trainer binary")
    parser.add_argument("--torchrun", default="", help="torchrun launcher (needed for --ranks > 1)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--device", required=True, help="cpu or cuda (the trainer's --device)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help="comma-separated subset of shampoo,adam,adamw,sgd (default: all)")
    parser.add_argument("--lrs", action="append", default=[], metavar="OPTIMIZER=LR,LR,...",
                        help="the lr grid of one optimizer (repeatable); every optimizer's grid "
                             "must have the same size")
    parser.add_argument("--widen", type=int, default=3,
                        help="times a grid may be widened past the edge its best lr is at, one "
                             "rate each (default 3; 0 = the grid as given)")
    parser.add_argument("--widen-factor", type=float, default=3.0,
                        help="the new rate is the edge rate times or divided by this (default 3)")
    parser.add_argument("--budget", help="full or reduced (default: full on cuda, reduced on "
                                         "cpu); the flags below override either")
    parser.add_argument("--epochs", type=int, help="epochs of every run (default: by device)")
    parser.add_argument("--limit-train", type=int,
                        help="train on the first this many examples, 0 = all (default: by device)")
    parser.add_argument("--seeds", help="comma-separated seeds; every (optimizer, lr) runs each "
                                        "(default: 2022)")
    parser.add_argument("--ranks", type=int, help="data-parallel ranks (default: by device)")
    parser.add_argument("--batch-size", type=int,
                        help="global batch (default: 256 for convnet and autoencoder, 32 "
                             "sequences for lm)")
    parser.add_argument("--target", type=float,
                        help="value of the workload's metric whose epochs and seconds the table "
                             "reports (convnet: test accuracy 0.90; autoencoder: test loss "
                             f"{WORKLOADS['autoencoder']['target']:g}; lm: validation perplexity "
                             f"{WORKLOADS['lm']['target']:g})")
    parser.add_argument("--data-dir", default="",
                        help="the workload's data folder (Fashion-MNIST, or the Penn Treebank for "
                             "lm; default: the trainer's)")
    parser.add_argument("--no-plot", action="store_true", help="no PNG (no matplotlib needed)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: rebuild the CSV, PNG and table from the runs that "
                             "the same command left in DIR/runs")
    args = parser.parse_args()
    try:
        resolve(args)
    except UsageError as error:
        parser.exit(2, f"compare_optimizers.py: {error}\n")
    plt = None if args.no_plot else import_pyplot()  # before hours of training, not after

    print(f"Optimizer comparison: {args.workload['title']}, {args.budget_name} budget: "
          f"{args.epochs} epoch(s), {args.workload['examples']}: "
          f"{args.limit_train if args.limit_train else 'all'}, global batch {args.batch_size}, "
          f"seeds {','.join(map(str, args.seeds))}, device {args.device}, {args.ranks} rank(s)")
    print("Learning-rate grid (the same size for every optimizer):")
    for optimizer in args.optimizers:
        print(f"  {optimizer:<8} {', '.join(map(format_lr, args.grid[optimizer]))}  "
              f"({OPTIMIZER_SUMMARY[optimizer]})")
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    results = train_all(args)
    summary = summarize(args, results)
    csv_path = output_path(args, "csv")
    write_csv(csv_path, args, results, summary)
    table = markdown_table(args, results, summary)
    with open(output_path(args, "md"), "w") as f:
        f.write(table)
    print()
    print(table)
    print(f"CSV: {csv_path}")
    if plt:
        png_path = output_path(args, "png")
        plot(png_path, args, summary, plt)
        print(f"Plot: {png_path}")
    if not args.report_only:
        print(f"Comparison wall time: {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
