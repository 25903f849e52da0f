#!/usr/bin/env python3
"""Golden data from the reference implementation (facebookresearch/optimizers, package
distributed_shampoo) for a C++ test that replays the same steps with our DistributedShampoo and
compares the final parameters (1e-8; 1e-6 for the iterative root solver).

Run with the torch that the project's LibTorch comes from and the reference exported from its git
mirror:

    mkdir -p /tmp/ref && git -C /work/.mirror/facebookresearch+optimizers/repo archive HEAD \\
        distributed_shampoo | tar -x -C /tmp/ref
    PYTHONPATH=~/.cache/distributed-shampoo/torch-2.11.0 python3 \\
        tests/shampoo/make_reference_golden.py --reference /tmp/ref

Every case: three float64 parameters, a (5, 4) matrix, a (3,) vector and a (2, 3, 4) tensor, with
values 0.5 * randn from a seeded torch.Generator; 8 steps, each with gradients randn (same
generator) written into p.grad; the reference DistributedShampoo on CPU, one thread, with every
state dtype of the preconditioner config set to float64 and max_preconditioner_dim 8.

Two things make the reference less than float64 unless handled:
  * it computes its bias corrections as torch.tensor(1.0) - beta ** step and beta1 ** (step - 1)
    with the step an int64 tensor, i.e. in the default dtype (float32: 1 - 0.999 comes out with a
    relative error of 1.3e-5). The script sets torch.set_default_dtype(torch.float64), so these
    are float64, as our optimizer computes them.
  * it keeps the learning rate in a float32 tensor (LR_TENSOR, torch.empty((), dtype=torch.float))
    and CORRECTED weight decay reads it back (LR_CPU_PINNED.item()) while peak_lr stays the Python
    float given at construction. The "lr STEP" lines hold that float32-rounded value, read back from
    the optimizer after each step (exact as a double); "set lr" holds the construction (peak) lr.

Output (one record per line, tokens separated by spaces, floats as repr(), which round-trips):
    # header comments
    case NAME
    set KEY VALUE...             our option vocabulary (see make_set_lines)
    param INDEX SHAPE VALUES...  SHAPE like 5,4; numel initial values, row-major
    lr STEP VALUE                lr the reference used at STEP (1-based)
    grad STEP INDEX VALUES...    gradient given at STEP
    after STEP INDEX VALUES...   parameter after STEP
    end
"""

import argparse
import logging
import math
import os
import sys
import zlib

STEPS = 8
SHAPES = [(5, 4), (3,), (2, 3, 4)]
MAX_PRECONDITIONER_DIM = 8
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden",
                           "reference_features.txt")

# ----------------------------------------------------------------------------------------------
# Cases. Each is a plain dict; build_optimizer() turns it into reference objects and
# make_set_lines() into our option vocabulary.
# ----------------------------------------------------------------------------------------------

WD_BASE = dict(
    lr=0.01, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=0.1,
    precondition_frequency=2, start_preconditioning_step=2, merge=True,
    grafting=("adam", 0.999, 1e-8), preconditioner="root_inv",
    # lr changed by hand in param_group before these steps.
    lr_changes={4: 0.004, 7: 0.007}, seed=1001,
)
TRACE_BASE = dict(
    lr=0.01, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=0.0,
    precondition_frequency=2, start_preconditioning_step=2, merge=True, grafting=None,
    use_trace_scaling=True, lr_changes={}, seed=1002,
)
IGNORED_BASE = dict(
    lr=0.01, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=0.0,
    precondition_frequency=2, start_preconditioning_step=2,
    # No merging: (2, 3, 4) stays a 3-D block, so the order-3 entries apply to it.
    merge=False, grafting=None, preconditioner="eigenvalue_corrected", lr_changes={}, seed=1003,
)
# Coupled higher-order root inverse (matrix_functions.py, matrix_inverse_root_higher_order):
#   lambda = ||A||_inf (max absolute row sum of the factor, bias-corrected; here beta2 = 1, so
#   no correction and weighting 1), ridge = clamp(rel_epsilon * lambda, min=abs_epsilon), i.e.
#   max(rel_epsilon * lambda, abs_epsilon), A_ridge = A + ridge * I. The group epsilon is NOT
#   passed to this solver. The factors here have ||A||_inf between about 1.2 and 68, so
#     *_rel: rel 1e-4, abs 1e-10: rel * lambda >= 1.1e-4 >> 1e-10, the relative branch wins;
#     *_abs: rel 1e-10, abs 1e-3: rel * lambda <= 6.8e-9 << 1e-3, the absolute branch wins.
#   check_higher_order() asserts the branch on every factor at every step, and that zeroing the
#   losing term leaves the result bit-identical while doubling the winning one moves it > 1e-6.
#   "order" is the convergence order of the iteration (2 = Newton, 3 = Halley-like with one more
#   term of the binomial series), not the root: the root is 1 / inverse exponent of the block
#   (4 for the 2-D blocks, 2 for the vector).
HO_BASE = dict(
    lr=0.01, betas=(0.0, 1.0), epsilon=1e-12, weight_decay=0.0,
    precondition_frequency=1, start_preconditioning_step=1, merge=True, grafting=None,
    preconditioner="root_inv", lr_changes={}, seed=1004,
)
HO_MAX_ITER = 100  # CoupledHigherOrderConfig defaults
HO_TOL = 1e-8


def _case(name, base, **kw):
    c = dict(base)
    c.update(kw)
    c["name"] = name
    return c


CASES = [
    _case("wd_l2", WD_BASE, weight_decay_type="L2"),
    _case("wd_decoupled", WD_BASE, weight_decay_type="DECOUPLED"),
    _case("wd_corrected", WD_BASE, weight_decay_type="CORRECTED"),
    _case("wd_independent", WD_BASE, weight_decay_type="INDEPENDENT"),
    # start_preconditioning_step 4 (not 2) for the two classic families: at step 2 the (3,)
    # block's factor has rank 2 (two gradients in R^3), its null eigenvalue is epsilon = 1e-12,
    # and without grafting the step-3 gradient's null-space part is multiplied by ~1e6 (the
    # parameters moved by ~760, and a 1e-4 relative change of epsilon moved the result by 0.03:
    # not reproducible). From step 3 on every factor has full rank. SOAP keeps start 2: its
    # eigenvalue correction is Adam-like in the basis and does not amplify the null direction.
    _case("trace_root_inv_e0.5", TRACE_BASE, preconditioner="root_inv",
          trace_scaling_exponent=0.5, start_preconditioning_step=4),
    _case("trace_root_inv_e1", TRACE_BASE, preconditioner="root_inv", trace_scaling_exponent=1.0,
          start_preconditioning_step=4),
    _case("trace_eigendecomposed_e0.5", TRACE_BASE, preconditioner="eigendecomposed",
          trace_scaling_exponent=0.5, start_preconditioning_step=4),
    _case("trace_eigendecomposed_e1", TRACE_BASE, preconditioner="eigendecomposed",
          trace_scaling_exponent=1.0, start_preconditioning_step=4),
    _case("trace_soap_e0.5", TRACE_BASE, preconditioner="eigenvalue_corrected",
          trace_scaling_exponent=0.5),
    _case("trace_soap_e1", TRACE_BASE, preconditioner="eigenvalue_corrected",
          trace_scaling_exponent=1.0),
    _case("ignored_dims_a", IGNORED_BASE, ignored_basis_change_dims={2: [0], 3: [1]}),
    _case("ignored_dims_b", IGNORED_BASE, ignored_basis_change_dims={1: [0], 3: [0, 2]}),
    _case("higher_order_o2_rel", HO_BASE, higher_order=(2, 1e-4, 1e-10), branch="rel"),
    _case("higher_order_o2_abs", HO_BASE, higher_order=(2, 1e-10, 1e-3), branch="abs"),
    _case("higher_order_o3_rel", HO_BASE, higher_order=(3, 1e-4, 1e-10), branch="rel"),
    _case("higher_order_o3_abs", HO_BASE, higher_order=(3, 1e-10, 1e-3), branch="abs"),
]

# ----------------------------------------------------------------------------------------------


def fmt(x):
    return repr(float(x))


def fmt_values(t):
    return " ".join(fmt(v) for v in t.detach().reshape(-1).tolist())


def make_set_lines(c):
    b1, b2 = c["betas"]
    lines = [
        f"lr {fmt(c['lr'])}",
        f"betas {fmt(b1)} {fmt(b2)}",
        f"epsilon {fmt(c['epsilon'])}",
        f"weight_decay {fmt(c['weight_decay'])}",
        # The reference's default type is DECOUPLED (irrelevant when weight_decay is 0).
        f"weight_decay_type {c.get('weight_decay_type', 'DECOUPLED')}",
        f"precondition_frequency {c['precondition_frequency']}",
        f"start_preconditioning_step {c['start_preconditioning_step']}",
        f"max_preconditioner_dim {MAX_PRECONDITIONER_DIM}",
        f"use_merge_dims {1 if c['merge'] else 0}",
    ]
    g = c["grafting"]
    lines.append("grafting none" if g is None else f"grafting adam {fmt(g[1])} {fmt(g[2])}")
    lines.append(f"preconditioner {c['preconditioner']}")
    if c.get("use_trace_scaling"):
        lines.append("use_trace_scaling 1")
        lines.append(f"trace_scaling_exponent {fmt(c['trace_scaling_exponent'])}")
    if "ignored_basis_change_dims" in c:
        spec = ";".join(f"{order}:{','.join(map(str, dims))}"
                        for order, dims in sorted(c["ignored_basis_change_dims"].items()))
        lines.append(f"ignored_basis_change_dims {spec}")
    if "higher_order" in c:
        order, rel, ab = c["higher_order"]
        lines.append(f"root_solver coupled_higher_order {order} {fmt(rel)} {fmt(ab)} "
                     f"{HO_MAX_ITER} {fmt(HO_TOL)}")
    return ["set " + s for s in lines]


def build_optimizer(ds, torch, params, c):
    """The reference optimizer for case c. ds: dict of the reference's names."""
    f64 = torch.float64
    common = dict(factor_matrix_dtype=f64)
    if c.get("use_trace_scaling"):
        common.update(use_trace_scaling=True,
                      trace_scaling_exponent=c["trace_scaling_exponent"])
    kind = c["preconditioner"]
    if kind == "root_inv":
        if "higher_order" in c:
            order, rel, ab = c["higher_order"]
            amortized = ds["CoupledHigherOrderConfig"](
                rel_epsilon=rel, abs_epsilon=ab, max_iterations=HO_MAX_ITER,
                tolerance=HO_TOL, order=order)
        else:
            amortized = ds["EigenConfig"]()
        pc = ds["RootInvShampooPreconditionerConfig"](
            amortized_computation_config=amortized, inv_factor_matrix_dtype=f64, **common)
    elif kind == "eigendecomposed":
        pc = ds["EigendecomposedShampooPreconditionerConfig"](
            factor_matrix_eigenvectors_dtype=f64, factor_matrix_eigenvalues_dtype=f64, **common)
    elif kind == "eigenvalue_corrected":
        pc = ds["EigenvalueCorrectedShampooPreconditionerConfig"](
            ignored_basis_change_dims=c.get("ignored_basis_change_dims", {}),
            factor_matrix_eigenvectors_dtype=f64, corrected_eigenvalues_dtype=f64, **common)
    else:
        raise ValueError(kind)

    g = c["grafting"]
    grafting = None if g is None else ds["AdamPreconditionerConfig"](beta2=g[1], epsilon=g[2])
    # use_merge_dims: the reference merges dims up to target_parameter_dimensionality (default 1);
    # math.inf turns merging off (merge_small_dims returns the shape unchanged).
    dist = ds["SingleDeviceDistributedConfig"](
        target_parameter_dimensionality=1 if c["merge"] else math.inf)
    return ds["DistributedShampoo"](
        params,
        lr=c["lr"],
        betas=c["betas"],
        epsilon=c["epsilon"],
        weight_decay=c["weight_decay"],
        weight_decay_type=ds["WeightDecayType"][c.get("weight_decay_type", "DECOUPLED")],
        max_preconditioner_dim=MAX_PRECONDITIONER_DIM,
        precondition_frequency=c["precondition_frequency"],
        start_preconditioning_step=c["start_preconditioning_step"],
        use_bias_correction=True,
        iterate_averaging_config=None,  # no momentum
        grafting_config=grafting,
        distributed_config=dist,
        preconditioner_config=pc,
    )


class _WarningCollector(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_case(ds, torch, c, higher_order_override=None, grad_noise=0.0):
    """Runs case c. Returns a dict with initial params, per-step lr/grads/params, block info and
    the per-step factor matrices (for the higher-order branch check). grad_noise > 0 adds
    grad_noise * |g| * randn (from a separate generator) to every gradient (conditioning check)."""
    if higher_order_override is not None:
        c = dict(c, higher_order=higher_order_override)
    gen = torch.Generator().manual_seed(c["seed"])
    noise_gen = torch.Generator().manual_seed(c["seed"] + 7)
    f64 = torch.float64
    init = [0.5 * torch.randn(s, generator=gen, dtype=f64) for s in SHAPES]
    params = [torch.nn.Parameter(t.clone()) for t in init]

    collector = _WarningCollector()
    ref_logger = logging.getLogger("distributed_shampoo")
    ref_logger.addHandler(collector)
    try:
        opt = build_optimizer(ds, torch, params, c)
        state_lists = opt._per_group_state_lists[0]
        blocks = [tuple(b.shape) for b in state_lists[ds["DISTRIBUTOR"]].local_blocked_params]
        shampoo_list = state_lists[ds["SHAMPOO_PRECONDITIONER_LIST"]]
        factor_dims = [tuple(int(m.shape[0]) for m in k.get_unpacked_factor_matrices())
                       for k in shampoo_list._local_kronecker_factors_unwrapped]
        steps = []
        for step in range(1, STEPS + 1):
            if step in c["lr_changes"]:
                opt.param_groups[0]["lr"] = c["lr_changes"][step]
            grads = [torch.randn(s, generator=gen, dtype=f64) for s in SHAPES]
            if grad_noise:
                grads = [g + grad_noise * g.abs() * torch.randn(g.shape, generator=noise_gen,
                                                                dtype=f64) for g in grads]
            for p, g in zip(params, grads):
                p.grad = g.clone()  # the reference may modify p.grad in place (L2)
            opt.step()
            lr_used = state_lists[ds["LR_TENSOR"]].item()
            factors = [[m.clone() for m in k.get_unpacked_factor_matrices()]
                       for k in shampoo_list._local_kronecker_factors_unwrapped]
            steps.append(dict(lr=lr_used, grads=grads,
                              params=[p.detach().clone() for p in params], factors=factors))
    finally:
        ref_logger.removeHandler(collector)
    bad = [m for m in collector.messages
           if "fail" in m.lower() or "converge" in m.lower() or "nan" in m.lower()]
    if bad:
        raise RuntimeError(f"{c['name']}: reference reported: {bad[:3]}")
    return dict(init=init, steps=steps, blocks=blocks, factor_dims=factor_dims)


def check_higher_order(ds, torch, c, result):
    """Asserts that every factor at every step takes c['branch'] of max(rel*||A||_inf, abs), that
    the losing term has no effect and that the winning one matters at the test tolerance."""
    order, rel, ab = c["higher_order"]
    ratios = []
    for s in result["steps"]:
        for block_factors in s["factors"]:
            for a in block_factors:
                lam = torch.linalg.matrix_norm(a, math.inf).item()
                ratios.append(rel * lam / ab)
    lo, hi = min(ratios), max(ratios)
    if c["branch"] == "rel":
        assert lo > 10.0, (c["name"], lo)
        losing, winning = (order, rel, 0.0), (order, 2 * rel, ab)
    else:
        assert hi < 0.1, (c["name"], hi)
        losing, winning = (order, 0.0, ab), (order, rel, 2 * ab)
    final = result["steps"][-1]["params"]
    same = run_case(ds, torch, c, higher_order_override=losing)["steps"][-1]["params"]
    moved = run_case(ds, torch, c, higher_order_override=winning)["steps"][-1]["params"]
    assert all(torch.equal(x, y) for x, y in zip(final, same)), c["name"]
    delta = max((x - y).abs().max().item() for x, y in zip(final, moved))
    assert delta > 1e-6, (c["name"], delta)
    return lo, hi, delta


def max_diff(xs, ys):
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


def check_conditioning(ds, torch, c, result):
    """The golden data is only useful if rounding-level differences in our implementation stay far
    below the test tolerance. Reruns c with every gradient perturbed by a relative 1e-12 and with
    epsilon scaled by (1 + 1e-6); both must move the final parameters by less than 1e-9."""
    final = result["steps"][-1]["params"]
    d_grad = max_diff(final, run_case(ds, torch, c, grad_noise=1e-12)["steps"][-1]["params"])
    d_eps = max_diff(final, run_case(ds, torch, dict(c, epsilon=c["epsilon"] * (1 + 1e-6)))
                     ["steps"][-1]["params"])
    assert d_grad < 1e-9 and d_eps < 1e-9, (c["name"], d_grad, d_eps)
    return d_grad, d_eps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True,
                    help="directory holding the distributed_shampoo package")
    ap.add_argument("--reference-commit", default="f606606")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    sys.path.insert(0, os.path.abspath(args.reference))
    import torch
    import distributed_shampoo as pkg
    from distributed_shampoo import shampoo_types as st
    from distributed_shampoo.preconditioner import matrix_functions_types as mft

    logging.getLogger("distributed_shampoo").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # bias corrections in float64 (see module doc)

    ds = dict(
        DistributedShampoo=pkg.DistributedShampoo,
        AdamPreconditionerConfig=st.AdamPreconditionerConfig,
        RootInvShampooPreconditionerConfig=st.RootInvShampooPreconditionerConfig,
        EigendecomposedShampooPreconditionerConfig=st.EigendecomposedShampooPreconditionerConfig,
        EigenvalueCorrectedShampooPreconditionerConfig=(
            st.EigenvalueCorrectedShampooPreconditionerConfig),
        SingleDeviceDistributedConfig=st.SingleDeviceDistributedConfig,
        WeightDecayType=st.WeightDecayType,
        DISTRIBUTOR=st.DISTRIBUTOR,
        LR_TENSOR=st.LR_TENSOR,
        SHAMPOO_PRECONDITIONER_LIST=st.SHAMPOO_PRECONDITIONER_LIST,
        EigenConfig=mft.EigenConfig,
        CoupledHigherOrderConfig=mft.CoupledHigherOrderConfig,
    )

    header = [
        "# Golden data: the reference Shampoo (facebookresearch/optimizers, distributed_shampoo)",
        "# on small float64 problems. Generated by tests/shampoo/make_reference_golden.py;",
        "# do not edit. Read by the C++ reference-features test.",
        f"# reference commit: {args.reference_commit}",
        f"# torch: {torch.__version__} (CPU, 1 thread, default dtype float64)",
        "# lr lines: the float32-rounded lr the reference multiplies by (LR_TENSOR is float32);",
        "# set lr: the construction lr, which the reference keeps as peak_lr (CORRECTED and",
        "# INDEPENDENT weight decay divide by it; later param_group lr changes do not touch it).",
        f"# shapes {' '.join(','.join(map(str, s)) for s in SHAPES)}; {STEPS} steps per case.",
    ]
    body = []
    results = {}
    for c in CASES:
        r = run_case(ds, torch, c)
        results[c["name"]] = r
        block_desc = " ".join(
            f"{','.join(map(str, b))}[{','.join(map(str, f)) or '-'}]"
            for b, f in zip(r["blocks"], r["factor_dims"]))
        header.append(f"# {c['name']}: blocks(factor dims) {block_desc}")
        body.append(f"case {c['name']}")
        body.extend(make_set_lines(c))
        for i, t in enumerate(r["init"]):
            body.append(f"param {i} {','.join(map(str, t.shape))} {fmt_values(t)}")
        for k, s in enumerate(r["steps"], start=1):
            body.append(f"lr {k} {fmt(s['lr'])}")
            for i, g in enumerate(s["grads"]):
                body.append(f"grad {k} {i} {fmt_values(g)}")
            for i, p in enumerate(s["params"]):
                body.append(f"after {k} {i} {fmt_values(p)}")
        body.append("end")

        moved = max_diff(r["steps"][-1]["params"], r["init"])
        d_grad, d_eps = check_conditioning(ds, torch, c, r)
        extra = f"; moved by 1e-12 grad noise {d_grad:.2g}, by eps*(1+1e-6) {d_eps:.2g}"
        if "higher_order" in c:
            lo, hi, delta = check_higher_order(ds, torch, c, r)
            extra += (f"; rel*||A||inf/abs in [{lo:.3g}, {hi:.3g}] -> {c['branch']} branch, "
                     f"doubling it moves {delta:.2g}")
        print(f"{c['name']}: blocks {block_desc}; max|final-initial| {moved:.4g}{extra}",
              flush=True)
        assert moved > 1e-3, c["name"]

    # The weight-decay variants must differ from each other.
    wd = [n for n in results if n.startswith("wd_")]
    for i, a in enumerate(wd):
        for b in wd[i + 1:]:
            d = max_diff(results[a]["steps"][-1]["params"], results[b]["steps"][-1]["params"])
            print(f"  {a} vs {b}: max|diff| {d:.4g}")
            assert d > 1e-6, (a, b, d)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(header + body) + "\n")
    print(f"wrote {args.out}: {len(CASES)} cases")


if __name__ == "__main__":
    main()
