"""What the torchrun workers (ddp_worker.py, fsdp2_worker.py) share: the optimizer settings and
how their results are compared with one process."""

import torch

import distributed_shampoo_cpp as ds

SHAMPOO = dict(lr=0.01, grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
               precondition_frequency=3, start_preconditioning_step=3)
# Where DDP's or FSDP2's gradient average is not exact (a world that is not a power of two: g/3
# summed three times is not g), the reference's settings (float32 factors, ε 1e-12) amplify that
# rounding through near-singular factors (measured: 0.12 apart after 9 steps at world 3); this
# engine's float64 factors with a relative ε keep such runs together (docs/math.md).
ROBUST = dict(SHAMPOO, relative_epsilon=1e-7,
              preconditioner_config=ds.RootInvShampooPreconditionerConfig(
                  factor_matrix_dtype=torch.float64, inv_factor_matrix_dtype=torch.float64))


def exact_average(world):
    return world & (world - 1) == 0


def same(a, b, exact):
    """Bit for bit where the average is exact, else within 5e-4 (measured at world 3: at most
    9.3e-5 under DDP and 1.3e-5 under FSDP2, for parameters of size ~0.5 that moved 0.09 to 0.42
    in the run; the reference's settings were 0.12 apart)."""
    return torch.equal(a, b) if exact else (a - b).abs().max().item() <= 5e-4
