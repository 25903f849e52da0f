"""The reference's own runs (tests/shampoo/golden/reference_features.txt, written by
tests/shampoo/make_reference_golden.py from facebookresearch/optimizers) replayed through the
Python package, with the keyword arguments and config classes a recipe for the reference uses:
weight decay CORRECTED and INDEPENDENT with the lr changed by hand, trace scaling, SOAP's
ignored_basis_change_dims, CoupledHigherOrderConfig. Every step's parameters within 1e-8 of the
reference's (1e-6 with the iterative solver), as the C++ test (reference_features_test.cpp)."""

import os
import unittest

import torch

import distributed_shampoo_cpp as ds

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "shampoo", "golden",
                      "reference_features.txt")


def read_golden():
    cases, case = [], None
    with open(GOLDEN) as file:
        for line in file:
            tokens = line.split()
            if not tokens or tokens[0].startswith("#"):
                continue
            kind, rest = tokens[0], tokens[1:]
            if kind == "case":
                case = {"name": rest[0], "set": {}, "params": {}, "lr": {}, "grad": {},
                        "after": {}}
                cases.append(case)
            elif kind == "set":
                case["set"][rest[0]] = rest[1:]
            elif kind == "param":
                shape = [int(d) for d in rest[1].split(",")]
                case["params"][int(rest[0])] = (shape, [float(x) for x in rest[2:]])
            elif kind == "lr":
                case["lr"][int(rest[0])] = float(rest[1])
            elif kind in ("grad", "after"):
                case[kind].setdefault(int(rest[0]), {})[int(rest[1])] = [float(x) for x in rest[2:]]
    return cases


def ignored_dims(text):
    out = {}
    for part in text.split(";"):
        order, dims = part.split(":")
        out[int(order)] = [int(d) for d in dims.split(",")]
    return out


def optimizer_for(case, params):
    """The reference's constructor call for the case, in float64 (its keyword names)."""
    s = case["set"]
    float64 = dict(factor_matrix_dtype=torch.float64)
    trace = {}
    if "use_trace_scaling" in s:
        trace = dict(use_trace_scaling=True,
                     trace_scaling_exponent=float(s["trace_scaling_exponent"][0]))
    family = s["preconditioner"][0]
    if family == "root_inv":
        amortized = ds.EigenConfig()
        if "root_solver" in s:
            order, rel, abs_, iterations, tolerance = s["root_solver"][1:]
            amortized = ds.CoupledHigherOrderConfig(
                rel_epsilon=float(rel), abs_epsilon=float(abs_), order=int(order),
                max_iterations=int(iterations), tolerance=float(tolerance))
        config = ds.RootInvShampooPreconditionerConfig(
            amortized_computation_config=amortized, inv_factor_matrix_dtype=torch.float64,
            **float64, **trace)
    elif family == "eigendecomposed":
        config = ds.EigendecomposedShampooPreconditionerConfig(
            factor_matrix_eigenvectors_dtype=torch.float64,
            factor_matrix_eigenvalues_dtype=torch.float64, **float64, **trace)
    else:
        extra = {}
        if "ignored_basis_change_dims" in s:
            extra["ignored_basis_change_dims"] = ignored_dims(s["ignored_basis_change_dims"][0])
        config = ds.EigenvalueCorrectedShampooPreconditionerConfig(
            factor_matrix_eigenvectors_dtype=torch.float64,
            corrected_eigenvalues_dtype=torch.float64, **float64, **trace, **extra)
    grafting = None
    if s["grafting"][0] == "adam":
        grafting = ds.AdamPreconditionerConfig(beta2=float(s["grafting"][1]),
                                               epsilon=float(s["grafting"][2]))
    return ds.DistributedShampoo(
        params, lr=float(s["lr"][0]), betas=tuple(float(b) for b in s["betas"]),
        epsilon=float(s["epsilon"][0]), weight_decay=float(s["weight_decay"][0]),
        weight_decay_type=getattr(ds.WeightDecayType, s["weight_decay_type"][0]),
        max_preconditioner_dim=int(s["max_preconditioner_dim"][0]),
        precondition_frequency=int(s["precondition_frequency"][0]),
        start_preconditioning_step=int(s["start_preconditioning_step"][0]),
        grafting_config=grafting, preconditioner_config=config,
        use_merge_dims=s["use_merge_dims"][0] == "1")


class ReferenceGolden(unittest.TestCase):
    def test_every_case_matches_the_reference_at_every_step(self):
        cases = read_golden()
        self.assertGreaterEqual(len(cases), 16)
        for case in cases:
            with self.subTest(case["name"]):
                shapes = [case["params"][i][0] for i in sorted(case["params"])]
                params = [torch.nn.Parameter(torch.tensor(case["params"][i][1],
                                                          dtype=torch.float64).view(shape))
                          for i, shape in enumerate(shapes)]
                optimizer = optimizer_for(case, params)
                tolerance = 1e-6 if "root_solver" in case["set"] else 1e-8
                for step in sorted(case["lr"]):
                    optimizer.param_groups[0]["lr"] = case["lr"][step]  # by hand, as theirs
                    for i, p in enumerate(params):
                        p.grad = torch.tensor(case["grad"][step][i],
                                              dtype=torch.float64).view(shapes[i])
                    optimizer.step()
                    for i, p in enumerate(params):
                        expected = torch.tensor(case["after"][step][i],
                                                dtype=torch.float64).view(shapes[i])
                        difference = (p.detach() - expected).abs().max().item()
                        self.assertLessEqual(difference, tolerance,
                                             f"step {step}, parameter {i}")


if __name__ == "__main__":
    unittest.main()
