"""distributed_shampoo_cpp.DistributedShampoo at one process: a torch.optim.Optimizer that follows
torch.optim's own optimizers, the C++ class, schedulers, GradScaler and state_dict round trips.

Run by CTest (python_tests, label python) with PYTHONPATH holding the built package and torch,
and SHAMPOO_CPP_TRAJECTORY naming tests/python/cpp_trajectory's binary."""

import copy
import io
import math
import os
import subprocess
import tempfile
import unittest
import warnings
from dataclasses import dataclass

import torch

import distributed_shampoo_cpp as ds
from support import (assert_bit_equal, batch, env, loss_of, make_model, params_of, train)


def never_preconditioned(lr, **kwargs):
    return dict(lr=lr, start_preconditioning_step=math.inf, precondition_frequency=1, **kwargs)


# (name, torch optimizer factory, DistributedShampoo keyword arguments): never preconditioning,
# Shampoo is its grafting method, which must be torch.optim's optimizer of the same name.
GRAFTING_CASES = [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.01),
     never_preconditioned(0.05, betas=(0.0, 1.0), weight_decay=0.01,
                          weight_decay_type=ds.WeightDecayType.L2,
                          grafting_config=ds.SGDPreconditionerConfig())),
    ("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.05, eps=1e-10, weight_decay=0.01),
     never_preconditioned(0.05, betas=(0.0, 1.0), weight_decay=0.01,
                          weight_decay_type=ds.WeightDecayType.L2,
                          grafting_config=ds.AdaGradPreconditionerConfig(epsilon=1e-10))),
    ("rmsprop", lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.95, eps=1e-8),
     never_preconditioned(0.01, betas=(0.0, 1.0),
                          grafting_config=ds.RMSpropPreconditionerConfig(beta2=0.95,
                                                                         epsilon=1e-8))),
    ("adam", lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-8, weight_decay=0.01),
     never_preconditioned(0.01, betas=(0.9, 0.999), weight_decay=0.01,
                          weight_decay_type=ds.WeightDecayType.L2,
                          grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8))),
    ("adamw", lambda p: torch.optim.AdamW(p, lr=0.01, eps=1e-8, weight_decay=0.01),
     never_preconditioned(0.01, betas=(0.9, 0.999), weight_decay=0.01,
                          grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8))),
    ("sgd_nesterov",
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     never_preconditioned(0.05, betas=(0.0, 1.0), weight_decay=1e-3,
                          weight_decay_type=ds.WeightDecayType.L2,
                          grafting_config=ds.SGDPreconditionerConfig(),
                          iterate_averaging_config=ds.ClassicMomentumConfig(
                              momentum=0.9, use_nesterov=True))),
]

SHAMPOO = dict(lr=0.01, grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
               precondition_frequency=4, start_preconditioning_step=4)


def two_groups(model, **kwargs):
    """The weights at lr 0.01, the biases at 0.02 (as cpp_trajectory.cpp)."""
    params = list(model.parameters())
    return ds.DistributedShampoo([{"params": [params[0], params[2]]},
                                  {"params": [params[1], params[3]], "lr": 0.02}], **kwargs)


def twin_of(model):
    """A model with `model`'s weights and a new optimizer over it (two_groups, SHAMPOO)."""
    copy = make_model()
    copy.load_state_dict(model.state_dict())
    return copy, two_groups(copy, **SHAMPOO)


def assert_continue_alike(test, original, resumed, steps, what):
    """Both (model, optimizer) runs take the same steps and end equal, bit for bit."""
    for model, optimizer in (original, resumed):
        train(model, optimizer, steps)
    assert_bit_equal(test, params_of(resumed[0]), params_of(original[0]), what)


class GraftingMatchesTorchOptim(unittest.TestCase):
    def test_each_grafting_config_is_its_torch_optimizer(self):
        for name, reference_of, kwargs in GRAFTING_CASES:
            with self.subTest(name):
                reference_model, model = make_model(), make_model()
                reference = reference_of(reference_model.parameters())
                optimizer = ds.DistributedShampoo(model.parameters(), **kwargs)
                self.assertIsInstance(optimizer, torch.optim.Optimizer)
                for t in range(1, 13):
                    train(reference_model, reference, range(t, t + 1))
                    train(model, optimizer, range(t, t + 1))
                    for a, e in zip(model.parameters(), reference_model.parameters()):
                        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6,
                                                   msg=lambda m: f"{name}, step {t}: {m}")
                moved = (params_of(model)[0] - params_of(make_model())[0]).abs().max()
                self.assertGreater(moved.item(), 1e-3)


class PythonMatchesCpp(unittest.TestCase):
    def test_the_same_run_from_both_fronts_is_bit_for_bit(self):
        binary = env("SHAMPOO_CPP_TRAJECTORY")
        if binary is None:
            self.skipTest("SHAMPOO_CPP_TRAJECTORY not set (CTest sets it)")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "params.pt")
            subprocess.run([binary, out], check=True)
            expected = list(torch.load(out, weights_only=False))  # torch::pickle_save's file
        model = make_model()
        train(model, two_groups(model, **SHAMPOO), range(1, 13))
        assert_bit_equal(self, params_of(model), expected, "Python vs C++")


class Schedulers(unittest.TestCase):
    def _run(self, make_scheduler):
        """Trains with the scheduler; returns the params and the lrs it set before each step."""
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        scheduler = make_scheduler(optimizer)
        lrs = []

        def record(t):
            lrs.append([g["lr"] for g in optimizer.param_groups])

        for t in range(1, 13):
            train(model, optimizer, range(t, t + 1), before_step=record)
            scheduler.step()
        return params_of(model), lrs

    def _by_hand(self, lrs):
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)

        def set_lrs(t):
            for group, lr in zip(optimizer.param_groups, lrs[t - 1]):
                group["lr"] = lr

        train(model, optimizer, range(1, 13), before_step=set_lrs)
        return params_of(model)

    def test_a_scheduler_is_the_same_lrs_set_by_hand(self):
        cases = {
            "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10,
                                                                          eta_min=1e-4),
            "lambda warm-up": lambda o: torch.optim.lr_scheduler.LambdaLR(
                o, lambda step: min(1.0, (step + 1) / 5)),
        }
        constant = make_model()
        train(constant, two_groups(constant, **SHAMPOO), range(1, 13))
        for name, make in cases.items():
            with self.subTest(name):
                scheduled, lrs = self._run(make)
                self.assertNotEqual(lrs[0], lrs[-1])
                assert_bit_equal(self, scheduled, self._by_hand(lrs), name)
                self.assertFalse(torch.equal(scheduled[0], params_of(constant)[0]),
                                 "the schedule changed nothing")


class StateDict(unittest.TestCase):
    def test_resumed_equals_uninterrupted_bit_for_bit(self):
        uninterrupted = make_model()
        optimizer = two_groups(uninterrupted, **SHAMPOO)
        train(uninterrupted, optimizer, range(1, 7))
        buffer = io.BytesIO()
        torch.save({"model": uninterrupted.state_dict(), "optimizer": optimizer.state_dict()},
                   buffer)
        train(uninterrupted, optimizer, range(7, 13))

        buffer.seek(0)
        saved = torch.load(buffer)  # weights_only: the state_dict holds plain values only
        resumed = make_model()
        resumed.load_state_dict(saved["model"])
        fresh = two_groups(resumed, **SHAMPOO)
        fresh.load_state_dict(saved["optimizer"])
        self.assertEqual(fresh.state[next(resumed.parameters())]["step"].item(), 6.0)
        train(resumed, fresh, range(7, 13))
        assert_bit_equal(self, params_of(resumed), params_of(uninterrupted), "resumed")

        # Without the optimizer's state the run differs (the comparison can fail).
        other = make_model()
        other.load_state_dict(saved["model"])
        train(other, two_groups(other, **SHAMPOO), range(7, 13))
        self.assertFalse(torch.equal(params_of(other)[0], params_of(uninterrupted)[0]))

    def test_the_references_dcp_flow_resumes_in_one_process(self):
        # The reference README's checkpointing: dcp.save({"model", "optim"}), and to resume
        # dcp.load into a new optimizer's state_dict(), then load_state_dict. The state grows as
        # it fills (DCP loads a tensor only into one of its size): the pieces are StatePiece
        # tensors, which DCP saves as objects.
        import torch.distributed.checkpoint as dcp

        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        fresh_size = optimizer.state_dict()["state"][0]["block_0"].numel()
        train(model, optimizer, range(1, 7))
        entry = optimizer.state_dict()["state"][0]
        self.assertEqual(sorted(k for k, v in entry.items() if type(v).__name__ == "StatePiece"),
                         ["block_0", "optimizer"])
        self.assertNotEqual(entry["block_0"].numel(), fresh_size)  # what DCP could not load
        copied = copy.deepcopy(entry)  # as the reference's checkpoint test does
        self.assertEqual(type(copied["block_0"]), type(entry["block_0"]))
        self.assertTrue(torch.equal(copied["block_0"], entry["block_0"]))
        with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: "no process group, loading in one process"
            dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                     checkpoint_id=directory)
            train(model, optimizer, range(7, 10))
            resumed = make_model()
            resumed_optimizer = two_groups(resumed, **SHAMPOO)
            state = {"model": resumed.state_dict(), "optim": resumed_optimizer.state_dict()}
            dcp.load(state, checkpoint_id=directory)
        resumed.load_state_dict(state["model"])
        resumed_optimizer.load_state_dict(state["optim"])
        train(resumed, resumed_optimizer, range(7, 10))
        assert_bit_equal(self, params_of(resumed), params_of(model), "resumed through DCP")

    def test_flattened_state_dicts_load_and_say_what_they_need(self):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict,
                                                             set_optimizer_state_dict)
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        train(model, optimizer, range(1, 6))
        saved = get_optimizer_state_dict(model, optimizer, options=flat)
        copy_, resumed = twin_of(model)
        with self.assertRaisesRegex(ValueError, "get_optimizer_state_dict"):
            set_optimizer_state_dict(copy_, resumed, saved, options=flat)
        get_optimizer_state_dict(copy_, resumed, options=flat)  # as a DCP recipe does
        set_optimizer_state_dict(copy_, resumed, saved, options=flat)
        assert_continue_alike(self, (model, optimizer), (copy_, resumed), range(6, 9),
                              "flattened round trip")

    def test_a_state_dict_of_the_earlier_layout_loads(self):
        # Before 2026-12-03 the pieces were plain 1-D uint8 tensors; such files still load.
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        train(model, optimizer, range(1, 7))
        saved = optimizer.state_dict()
        for entry in saved["state"].values():
            for key, value in entry.items():
                if key != "step":
                    entry[key] = value.as_subclass(torch.Tensor).clone()
        copy, resumed = twin_of(model)
        resumed.load_state_dict(saved)
        assert_continue_alike(self, (model, optimizer), (copy, resumed), range(7, 10),
                              "uint8 pieces")

    def test_loaded_floats_come_from_the_state_dict(self):
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        train(model, optimizer, range(1, 3))
        state = optimizer.state_dict()
        state["param_groups"][0]["lr"] = 0.005
        optimizer.load_state_dict(state)
        self.assertEqual(optimizer.param_groups[0]["lr"], 0.005)

    def test_a_state_dict_of_another_structure_is_refused(self):
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        train(model, optimizer, range(1, 3))
        other = two_groups(make_model(), **dict(SHAMPOO, precondition_frequency=5))
        with self.assertRaisesRegex(ValueError, "precondition_frequency"):
            other.load_state_dict(optimizer.state_dict())

    def test_state_is_there_from_construction_and_dcp_takes_no_step(self):
        from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                             set_optimizer_state_dict)
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        before = params_of(model)
        self.assertEqual(len(optimizer.state), 4)
        get_optimizer_state_dict(model, optimizer)
        assert_bit_equal(self, params_of(model), before, "get_optimizer_state_dict moved params")
        self.assertEqual(optimizer.stats()["amortized_computations"], 0)

        train(model, optimizer, range(1, 7))
        saved = get_optimizer_state_dict(model, optimizer)
        copy, resumed = twin_of(model)
        set_optimizer_state_dict(copy, resumed, saved)
        assert_continue_alike(self, (model, optimizer), (copy, resumed), range(7, 10),
                              "DCP state dict round trip")


class GradScalerSkipsOverflow(unittest.TestCase):
    def test_an_inf_gradient_skips_the_step_and_changes_nothing(self):
        scaled, plain = make_model(), make_model()
        scaled_opt = two_groups(scaled, **SHAMPOO)
        plain_opt = two_groups(plain, **SHAMPOO)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for t in range(1, 9):
            scaled_opt.zero_grad()
            scaler.scale(loss_of(scaled, t)).backward()
            if t == 5:
                next(scaled.parameters()).grad[0, 0] = math.inf
            scaler.step(scaled_opt)
            scaler.update()
            if t != 5:
                train(plain, plain_opt, range(t, t + 1))
        self.assertEqual(scaler.get_scale(), 2.0**9)
        self.assertEqual(scaled_opt.state[next(scaled.parameters())]["step"].item(), 7.0)
        for a, e in zip(scaled.parameters(), plain.parameters()):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@dataclass(kw_only=True)
class AdamPreconditionerConfig:  # a stand-in for the reference's class of the same name
    beta2: float = 0.999
    epsilon: float = 1e-10
    drop_weighting_factor_on_gsquare: bool = False


@dataclass(kw_only=True)
class RootInvShampooPreconditionerConfig:  # the reference's fields, one of them set
    amortized_computation_config: object = None
    drop_weighting_factor_on_gsquare: bool = False
    factor_matrix_dtype: torch.dtype = torch.float32
    num_tolerated_failed_amortized_computations: int = 3
    use_symmetric_packing: bool = True
    use_trace_scaling: bool = False
    trace_scaling_exponent: float = 0.5
    inverse_exponent_override: dict = None
    inv_factor_matrix_dtype: torch.dtype = torch.float32
    some_future_field: int = 0


def newton_schulz_run(config):
    model = make_model()
    kwargs = dict(SHAMPOO, epsilon=1e-4, preconditioner_config=ds.RootInvShampooPreconditionerConfig(
        amortized_computation_config=config))
    train(model, two_groups(model, **kwargs), range(1, 13))
    return params_of(model)


class NewtonSchulzRoots(unittest.TestCase):
    """The reference's NewtonSchulzRootInvConfig reaches the engine's Newton-Schulz solver with its
    fields: near the eigh run where the ridge is ε, its default schedule the engine's, and its
    relative_epsilon and coefficients followed."""

    def test_newton_schulz_config_reaches_the_solver(self):
        eigh = newton_schulz_run(ds.EigenConfig())
        default = newton_schulz_run(ds.NewtonSchulzRootInvConfig())
        for a, e in zip(default, eigh):
            torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-4)
        self.assertEqual(len(ds.NewtonSchulzRootInvConfig().coefficients), 10)
        explicit = newton_schulz_run(ds.NewtonSchulzRootInvConfig(
            coefficients=ds.NewtonSchulzRootInvConfig().coefficients))
        assert_bit_equal(self, explicit, default, "the default schedule written out")
        ridged = newton_schulz_run(ds.NewtonSchulzRootInvConfig(relative_epsilon=0.5))
        shorter = newton_schulz_run(ds.NewtonSchulzRootInvConfig(
            coefficients=ds.NewtonSchulzRootInvConfig().coefficients[:3]))
        for other in (ridged, shorter):
            self.assertGreater(max((a - d).abs().max().item() for a, d in zip(other, default)),
                               0.0)


class ReferenceConfigs(unittest.TestCase):
    def test_the_references_objects_are_read_by_class_name_and_fields(self):
        ours, theirs = make_model(), make_model()
        train(ours, two_groups(ours, **SHAMPOO), range(1, 9))
        kwargs = dict(SHAMPOO, grafting_config=AdamPreconditionerConfig(epsilon=1e-8))
        train(theirs, two_groups(theirs, **kwargs), range(1, 9))
        assert_bit_equal(self, params_of(theirs), params_of(ours), "stand-in config")

    def test_an_unsupported_field_is_an_error_naming_it(self):
        cases = [
            (dict(preconditioner_config=RootInvShampooPreconditionerConfig(some_future_field=1)),
             "some_future_field"),
            (dict(preconditioner_config=ds.RootInvShampooPreconditionerConfig(
                use_trace_scaling=True, trace_scaling_exponent=1.5)), "trace_scaling_exponent"),
            (dict(preconditioner_config=ds.RootInvShampooPreconditionerConfig(
                amortized_computation_config=ds.CoupledHigherOrderConfig(
                    rel_epsilon=1e-3, abs_epsilon=1e-6, disable_tf32=False))), "disable_tf32"),
            (dict(preconditioner_config=ds.RootInvShampooPreconditionerConfig(
                amortized_computation_config=ds.NewtonSchulzRootInvConfig(disable_tf32=False))),
             "disable_tf32"),
            (dict(preconditioner_config=ds.RootInvShampooPreconditionerConfig(
                amortized_computation_config=ds.NewtonSchulzRootInvConfig(coefficients=[]))),
             "coefficients"),
            (dict(preconditioner_config=ds.EigenvalueCorrectedShampooPreconditionerConfig(
                ignored_basis_change_dims={2: [5]})), "ignored_basis_change_dims"),
            (dict(weight_decay_type=ds.WeightDecayType.CORRECTED, lr=0.0), "peak_lr"),
            (dict(weight_decay_type="SOMETHING"), "weight_decay_type"),
            (dict(grafting_config=ds.EigenConfig()), "grafting_config"),
            (dict(lr=-1.0), "lr"),
        ]
        for kwargs, fragment in cases:
            with self.subTest(fragment):
                with self.assertRaisesRegex(ValueError, fragment):
                    ds.DistributedShampoo(make_model().parameters(), **kwargs)


# The names the reference's package exports (distributed_shampoo/__init__.py's __all__ at
# facebookresearch/optimizers f606606): a script that imports any of them must still import after
# its import line names this package.
REFERENCE_EXPORTS = """
    AdaGradPreconditionerConfig AdamPreconditionerConfig BaseShampooPreconditionerConfig
    ClassicShampooPreconditionerConfig CoupledHigherOrderConfig CoupledNewtonConfig
    DDPDistributedConfig DefaultEigenConfig DefaultEigendecompositionConfig
    DefaultEigenvalueCorrectedShampooConfig DefaultNewtonSchulzOrthogonalizationConfig
    DefaultPerturbationConfig DefaultSOAPConfig DefaultShampooConfig
    DefaultSignDescentPreconditionerConfig DefaultSingleDeviceDistributedConfig
    DefaultSpectralDescentPreconditionerConfig DistributedConfig DistributedShampoo EigenConfig
    EigendecomposedKLShampooPreconditionerConfig EigendecomposedShampooPreconditionerConfig
    EigendecompositionConfig EigenvalueCorrectedShampooPreconditionerConfig
    EighEigendecompositionConfig FSDPDistributedConfig FSDPParamAssignmentStrategy
    FullyShardDistributedConfig GeneralizedPrimalAveragingConfig HSDPDistributedConfig
    HybridShardDistributedConfig IterateAveragingConfig MatrixFunctionConfig
    NewtonSchulzOrthogonalizationConfig OrthogonalizationConfig PerturbationConfig
    PreconditionerConfig PseudoInverseConfig QREigendecompositionConfig
    RMSpropPreconditionerConfig RankDeficientStabilityConfig RootInvConfig
    RootInvKLShampooPreconditionerConfig RootInvShampooPreconditionerConfig
    SGDPreconditionerConfig SVDOrthogonalizationConfig ScheduleFreeConfig
    ShampooPT2CompileConfig SignDescentPreconditionerConfig SingleDeviceDistributedConfig
    SpectralDescentPreconditionerConfig WeightDecayType compile_fsdp_parameter_metadata
""".split()


class ReferenceImports(unittest.TestCase):
    def test_every_name_the_reference_exports_imports(self):
        missing = [name for name in REFERENCE_EXPORTS
                   if name not in ds.__all__ or not hasattr(ds, name)]
        self.assertEqual(missing, [])

    def test_a_pt2_compile_config_is_accepted_and_changes_nothing(self):
        plain, compiled = make_model(), make_model()
        train(plain, two_groups(plain, **SHAMPOO), range(1, 9))
        config = ds.ShampooPT2CompileConfig(backend="eager", fullgraph=False)
        self.assertEqual(config.backend, "eager")
        train(compiled, two_groups(compiled, shampoo_pt2_compile_config=config, **SHAMPOO),
              range(1, 9))
        assert_bit_equal(self, params_of(compiled), params_of(plain), "with a PT2 config")
        with self.assertRaisesRegex(ValueError, "shampoo_pt2_compile_config='eager'"):
            ds.DistributedShampoo(make_model().parameters(), shampoo_pt2_compile_config="eager")

    def test_the_fsdp1_and_hybrid_configs_import_and_are_refused_by_name(self):
        model = make_model()
        for config in (ds.FSDPDistributedConfig(param_to_metadata={}),
                       ds.HSDPDistributedConfig(param_to_metadata={}, device_mesh=None),
                       ds.HybridShardDistributedConfig(device_mesh=None)):
            with self.subTest(type(config).__name__):
                with self.assertRaisesRegex(ValueError, type(config).__name__):
                    ds.DistributedShampoo(model.parameters(), distributed_config=config)
        with self.assertRaisesRegex(NotImplementedError, "FSDPDistributedConfig"):
            ds.compile_fsdp_parameter_metadata(model)


class WeightDecayTypes(unittest.TestCase):
    def test_corrected_and_independent_divide_by_the_constructors_lr(self):
        # SGD as the family, a zero gradient: one step moves W = 1 by -lr * alpha.
        for name, alpha in (("DECOUPLED", lambda lr: 0.5),
                            ("CORRECTED", lambda lr: 0.5 * lr / 0.1),
                            ("INDEPENDENT", lambda lr: 0.5 / 0.1)):
            with self.subTest(name):
                w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
                optimizer = ds.DistributedShampoo(
                    [w], lr=0.1, betas=(0.0, 1.0), weight_decay=0.5,
                    weight_decay_type=getattr(ds.WeightDecayType, name),
                    preconditioner_config=ds.SGDPreconditionerConfig())
                self.assertEqual(optimizer.param_groups[0]["peak_lr"], 0.1)
                scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
                for lr in (0.1, 0.05):
                    with torch.no_grad():
                        w.fill_(1.0)
                    w.grad = torch.zeros_like(w)
                    optimizer.step()
                    self.assertAlmostEqual(w[0].item(), 1.0 - lr * alpha(lr), places=15)
                    scheduler.step()
                self.assertEqual(optimizer.param_groups[0]["peak_lr"], 0.1)


class ParamGroups(unittest.TestCase):
    def test_a_structural_change_is_an_error_and_floats_are_checked(self):
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        optimizer.param_groups[1]["precondition_frequency"] = 7
        with self.assertRaisesRegex(ValueError, "precondition_frequency changed from 4 to 7"):
            train(model, optimizer, range(1, 2))
        optimizer.param_groups[1]["precondition_frequency"] = 4
        optimizer.param_groups[0]["betas"] = (1.5, 0.999)
        with self.assertRaisesRegex(ValueError, r"param group 0: betas\[0\]=1.5"):
            train(model, optimizer, range(1, 2))

    def test_groups_that_differ_in_floats_are_one_virtual_group(self):
        model = make_model()
        optimizer = two_groups(model, **SHAMPOO)
        self.assertEqual(optimizer.stats()["virtual_groups"], 1)

    def test_add_param_group_and_closure(self):
        model = make_model()
        params = list(model.parameters())
        optimizer = ds.DistributedShampoo(params[:2], **SHAMPOO)
        optimizer.add_param_group({"params": params[2:], "lr": 0.02})
        self.assertEqual(len(optimizer.state), 4)
        expected = make_model()
        train(expected, two_groups(expected, **SHAMPOO), range(1, 2))

        def closure():
            optimizer.zero_grad()
            loss = loss_of(model, 1)
            loss.backward()
            return loss

        loss = optimizer.step(closure)
        self.assertEqual(loss.item(), loss_of(make_model(), 1).item())
        # Group 1 here holds the second layer at lr 0.02; two_groups() puts all biases there.
        self.assertFalse(torch.equal(params_of(model)[2], params_of(make_model())[2]))

    def test_iterate_averaging_eval_and_train(self):
        model = make_model()
        optimizer = ds.DistributedShampoo(
            model.parameters(), **dict(SHAMPOO, iterate_averaging_config=ds.ScheduleFreeConfig()))
        train(model, optimizer, range(1, 5))
        training = params_of(model)
        optimizer.eval()
        self.assertFalse(torch.equal(params_of(model)[0], training[0]))
        with self.assertRaisesRegex(RuntimeError, "eval"):
            train(model, optimizer, range(5, 6))
        optimizer.train()
        for a, e in zip(params_of(model), training):
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)


class Package(unittest.TestCase):
    def test_a_torch_of_another_version_is_refused_at_import(self):
        saved = torch.__version__
        try:
            torch.__version__ = "0.0.1"
            with self.assertRaisesRegex(ImportError, "built against torch"):
                ds._check_torch()
        finally:
            torch.__version__ = saved

    def test_the_recorded_torch_version_is_the_compiled_one(self):
        from distributed_shampoo_cpp import _C, _build_info
        self.assertEqual(_build_info.TORCH_VERSION, _C.TORCH_VERSION)

    def test_library_warnings_are_python_warnings(self):
        # A 1-D parameter of 2048 with the reference's defaults: a 2048 x 2048 factor and root,
        # 2000x its bytes; the library warns (TORCH_WARN) when the optimizer is built.
        vector = torch.zeros(2048, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds.DistributedShampoo([vector], max_preconditioner_dim=2048)
        messages = [str(w.message) for w in caught]
        self.assertTrue(any("Shampoo's state will take" in m for m in messages), messages)

if __name__ == "__main__":
    unittest.main()
