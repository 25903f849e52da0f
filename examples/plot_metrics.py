#!/usr/bin/env python3
"""Plots the metrics that cifar10_trainer writes with --metrics-dir.

    plot_metrics.py METRICS_DIR [--output PNG] [--title TEXT]

Reads METRICS_DIR/train.csv (one row per iteration) and METRICS_DIR/eval.csv (one row per
epoch) and draws two panels: the global training losses (lifetime and window) against the
iteration, and the test accuracy (and test loss) per epoch. Writes METRICS_DIR/metrics.png
unless --output says otherwise.

Needs matplotlib (scripts/install_deps.sh unpacks it next to LibTorch):
    PYTHONPATH=~/.cache/distributed-shampoo/torch-2.11.0 python3 examples/plot_metrics.py DIR
"""

import argparse
import csv
import os
import sys


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics_dir", help="the trainer's --metrics-dir")
    parser.add_argument("--output", help="PNG to write (default: METRICS_DIR/metrics.png)")
    parser.add_argument("--title", default="", help="title above the panels")
    args = parser.parse_args()

    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as error:
        sys.exit(
            f"plot_metrics.py: matplotlib is not importable ({error}); run scripts/install_deps.sh "
            "and set PYTHONPATH to the folder it prints (see examples/README.md)"
        )

    train = read_csv(os.path.join(args.metrics_dir, "train.csv"))
    evals = read_csv(os.path.join(args.metrics_dir, "eval.csv"))
    if not train:
        sys.exit(f"plot_metrics.py: {args.metrics_dir}/train.csv has no rows")
    output = args.output or os.path.join(args.metrics_dir, "metrics.png")

    iterations = [int(r["iteration"]) for r in train]
    figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(12, 4.5))

    loss_axes.plot(iterations, [float(r["global_loss"]) for r in train], color="0.8",
                   linewidth=0.6, label="batch loss")
    loss_axes.plot(iterations, [float(r["global_window_loss"]) for r in train], color="C0",
                   linewidth=1.2, label="window loss")
    loss_axes.plot(iterations, [float(r["global_lifetime_loss"]) for r in train], color="C1",
                   linewidth=1.5, label="lifetime loss")
    # Epoch boundaries.
    for r in evals:
        loss_axes.axvline(int(r["iteration"]), color="0.6", linestyle=":", linewidth=0.8)
    loss_axes.set_xlabel("iteration")
    loss_axes.set_ylabel("training loss (mean over ranks)")
    loss_axes.set_yscale("log")
    loss_axes.grid(True, which="both", alpha=0.3)
    loss_axes.legend()
    loss_axes.set_title("training loss")

    if evals:
        epochs = [int(r["epoch"]) for r in evals]
        accuracy = [float(r["test_accuracy"]) for r in evals]
        accuracy_axes.plot(epochs, accuracy, marker="o", color="C2", label="test accuracy")
        for epoch, value in zip(epochs, accuracy):
            accuracy_axes.annotate(f"{value:.4f}", (epoch, value), textcoords="offset points",
                                   xytext=(0, 6), ha="center", fontsize=8)
        accuracy_axes.set_xticks(epochs)
        loss_twin = accuracy_axes.twinx()
        loss_twin.plot(epochs, [float(r["test_loss"]) for r in evals], marker="s", color="C3",
                       linestyle="--", label="test loss")
        loss_twin.set_ylabel("test loss")
        lines = accuracy_axes.get_lines() + loss_twin.get_lines()
        accuracy_axes.legend(lines, [line.get_label() for line in lines], loc="center right")
    accuracy_axes.set_xlabel("epoch")
    accuracy_axes.set_ylabel("test accuracy")
    accuracy_axes.grid(True, alpha=0.3)
    accuracy_axes.set_title("test set")

    if args.title:
        figure.suptitle(args.title)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    print(f"Plot: {output}")


if __name__ == "__main__":
    main()
