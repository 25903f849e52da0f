#!/usr/bin/env python3
"""Golden data for tests/amp/grad_scaler_test.cpp: PyTorch's own torch.amp.GradScaler on a fixed
sequence of gradients, overflows included.

Run with the torch that the project's LibTorch comes from (the unpacked wheel in the deps cache):

    PYTHONPATH=~/.cache/distributed-shampoo/torch-2.11.0 \
        python3 tests/amp/make_grad_scaler_golden.py > tests/amp/golden/grad_scaler_sgd.txt

The run, which the C++ test repeats with shampoo::GradScaler and torch::optim::SGD:
  - model: Linear(4, 8) -> tanh -> Linear(8, 2), float32, weights and biases filled from
    sin(0.37 * i) * 0.5 in row-major order (no random generator on either side);
  - step t = 1..3000: inputs x[i, j] = sin(0.1 * (8 * i + j) + 0.01 * t) over a 16 x 4 batch,
    targets y[i, k] = cos(0.05 * (2 * i + k) + 0.02 * t), loss = mean((model(x) - y)^2);
  - optimizer SGD(lr 0.01); GradScaler("cpu") with its defaults (2^16, x2 every 2000 clean steps,
    x0.5 on overflow);
  - scaler.scale(loss).backward(); at the steps in OVERFLOWS, element 0 of the first weight's
    gradient becomes inf (or NaN at the steps in NANS); at steps divisible by 7, scaler.unscale_()
    first; scaler.step(optimizer); scaler.update().
Output: first "kernels <hex of the step-1 loss> <hex of every scaled gradient of step 1>", a
fingerprint of the machine's forward and backward kernels (BLAS and vectorized paths differ between
processors, and with them the last bits of a trajectory); then a line per step "t scale
growth_tracker skipped" (scale after update); then "param <i> <hex of each float32, little endian>"
for the final parameters.
"""
import math
import struct
import sys

import torch

STEPS = 3000
OVERFLOWS = {5, 6, 100, 101, 102, 2500, 2999}
NANS = {2600}


def filled(shape, start):
    n = math.prod(shape)
    values = (torch.arange(start, start + n, dtype=torch.float32) * 0.37).sin() * 0.5
    return values.reshape(shape), start + n


def hex_words(values):
    return " ".join(struct.pack("<f", v).hex() for v in values)


def main():
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    start = 0
    with torch.no_grad():
        for p in model.parameters():
            values, start = filled(p.shape, start)
            p.copy_(values)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    rows = torch.arange(16, dtype=torch.float32).reshape(16, 1)
    out = sys.stdout
    for t in range(1, STEPS + 1):
        x = ((rows * 8 + torch.arange(4, dtype=torch.float32)) * 0.1 + 0.01 * t).sin()
        y = ((rows * 2 + torch.arange(2, dtype=torch.float32)) * 0.05 + 0.02 * t).cos()
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        if t == 1:
            words = [hex_words([loss.item()])]
            words += [hex_words(p.grad.reshape(-1).tolist()) for p in model.parameters()]
            out.write("kernels " + " ".join(words) + "\n")
        first = next(model.parameters())
        if t in OVERFLOWS:
            first.grad.view(-1)[0] = float("inf")
        if t in NANS:
            first.grad.view(-1)[0] = float("nan")
        if t % 7 == 0:
            scaler.unscale_(optimizer)
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = 1 if scaler.get_scale() < scale_before else 0
        out.write(f"{t} {scaler.get_scale():.17g} {scaler._get_growth_tracker()} {skipped}\n")
    for i, p in enumerate(model.parameters()):
        out.write(f"param {i} {hex_words(p.detach().reshape(-1).tolist())}\n")


if __name__ == "__main__":
    main()
