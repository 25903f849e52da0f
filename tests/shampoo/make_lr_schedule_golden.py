#!/usr/bin/env python3
"""Golden data for tests/shampoo/lr_schedulers_test.cpp: the learning rates that PyTorch's own
schedulers (torch.optim.lr_scheduler LambdaLR, LinearLR, CosineAnnealingLR, SequentialLR) set,
step by step, for the cases the C++ test repeats with shampoo::LambdaLr, LinearLr,
CosineAnnealingLr, SequentialLr and warmup_cosine.

Run with the torch that the project's LibTorch comes from (the unpacked wheel in the deps cache):

    PYTHONPATH=~/.cache/distributed-shampoo/torch-2.11.0 \
        python3 tests/shampoo/make_lr_schedule_golden.py > tests/shampoo/golden/lr_schedules.txt

Each case: an SGD optimizer over one zero parameter per param group, with the group lrs of the
case; the schedulers made in the order listed (as a user writes them); then STEPS times
optimizer.step() followed by scheduler.step(). Output: a line "torch <version>", then per case
and param group one line "<case> <group> <lr after construction> <lr after step 1> ... <lr after
step STEPS>", every lr as float.hex() (exact; C's strtod reads it back to the same double).
"""
import sys

import torch
from torch.optim import lr_scheduler as sched

STEPS = 60


def pow95(epoch):
    return 0.95**epoch


def harmonic(epoch):
    return 1.0 / (epoch + 1)


def ramp(epoch):
    return min(1.0, (epoch + 1) / 10)


def sequential(opt, schedulers, milestones):
    return sched.SequentialLR(opt, schedulers, milestones)


# name -> (group lrs, function of the optimizer that makes the scheduler). The C++ test has the
# same table (lr_schedulers_test.cpp, kCases).
CASES = {
    "lambda_pow": ([0.1, 0.03], lambda o: sched.LambdaLR(o, pow95)),
    "lambda_per_group": ([0.1, 0.03], lambda o: sched.LambdaLR(o, [pow95, harmonic])),
    "lambda_ramp": ([0.2], lambda o: sched.LambdaLR(o, ramp)),
    "linear_default": ([0.05], lambda o: sched.LinearLR(o)),
    "linear_warmup": ([0.1, 0.003],
                      lambda o: sched.LinearLR(o, start_factor=0.01, end_factor=1.0,
                                               total_iters=25)),
    "linear_decay": ([0.2], lambda o: sched.LinearLR(o, start_factor=1.0, end_factor=0.1,
                                                     total_iters=40)),
    "linear_to_zero": ([0.07], lambda o: sched.LinearLR(o, start_factor=0.5, end_factor=0.0,
                                                        total_iters=10)),
    "cosine": ([0.1, 0.025], lambda o: sched.CosineAnnealingLR(o, T_max=20)),
    "cosine_eta_min": ([0.1, 0.003], lambda o: sched.CosineAnnealingLR(o, T_max=13,
                                                                      eta_min=1e-4)),
    "cosine_t_max_1": ([0.1], lambda o: sched.CosineAnnealingLR(o, T_max=1, eta_min=0.01)),
    "cosine_long": ([3e-4], lambda o: sched.CosineAnnealingLR(o, T_max=57, eta_min=1e-6)),
    "sequential_warmup_cosine": (
        [0.1, 0.02],
        lambda o: sequential(o, [sched.LinearLR(o, start_factor=0.01, end_factor=1.0,
                                                total_iters=10),
                                 sched.CosineAnnealingLR(o, T_max=40, eta_min=1e-5)], [10])),
    "sequential_three": (
        [0.1, 0.03],
        lambda o: sequential(o, [sched.LinearLR(o, start_factor=0.1, total_iters=5),
                                 sched.CosineAnnealingLR(o, T_max=10, eta_min=1e-3),
                                 sched.LambdaLR(o, pow95)], [5, 15])),
    "sequential_cosine_first": (
        [0.05],
        lambda o: sequential(o, [sched.CosineAnnealingLR(o, T_max=8, eta_min=1e-3),
                                 sched.LinearLR(o, start_factor=0.5, end_factor=1.0,
                                                total_iters=4)], [8])),
    "sequential_lambda_first": (
        [0.05],
        lambda o: sequential(o, [sched.LambdaLR(o, ramp),
                                 sched.CosineAnnealingLR(o, T_max=30)], [12])),
    # At the milestone CosineAnnealingLR restarts from its closed form, eta_min + (base_lr -
    # eta_min), which for 0.3 and 0.03 is not 0.3.
    "sequential_restart_rounding": (
        [0.3, 0.1],
        lambda o: sequential(o, [sched.LinearLR(o, start_factor=0.2, total_iters=6),
                                 sched.CosineAnnealingLR(o, T_max=20, eta_min=0.03)], [6])),
    "sequential_one": ([0.05], lambda o: sequential(o, [sched.LinearLR(o, total_iters=7)], [])),
    # shampoo::warmup_cosine(optimizer, {warmup_steps 10, total_steps 50, start_factor 0.01,
    # eta_min 1e-5}): SequentialLR of LinearLR and CosineAnnealingLR(T_max = 50 - 10).
    "warmup_cosine": (
        [0.1, 0.02],
        lambda o: sequential(o, [sched.LinearLR(o, start_factor=0.01, end_factor=1.0,
                                                total_iters=10),
                                 sched.CosineAnnealingLR(o, T_max=40, eta_min=1e-5)], [10])),
    "warmup_cosine_no_warmup": ([0.1], lambda o: sched.CosineAnnealingLR(o, T_max=30)),
}


def run(lrs, make):
    params = [torch.zeros(1, requires_grad=True) for _ in lrs]
    opt = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])
    scheduler = make(opt)
    history = [[g["lr"] for g in opt.param_groups]]
    for _ in range(STEPS):
        opt.step()
        scheduler.step()
        history.append([g["lr"] for g in opt.param_groups])
    return history


def main():
    out = sys.stdout
    out.write(f"torch {torch.__version__}\n")
    for name, (lrs, make) in CASES.items():
        history = run(lrs, make)
        for group in range(len(lrs)):
            values = " ".join(float(step[group]).hex() for step in history)
            out.write(f"{name} {group} {values}\n")


if __name__ == "__main__":
    main()
