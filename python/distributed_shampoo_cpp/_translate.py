"""The reference's keyword arguments and config objects, translated into the flat option
dictionaries that the C++ engine reads (python/src/options_from_python.cpp).

A config is recognised by its class name and read through its fields, so the reference's own
objects and this package's (`_configs.py`) are treated alike. A field that the engine does not
support is refused unless it holds the value the engine implements; a field that is not known at
all is refused too: nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import torch

# The C++ engine's float dtypes, by name.
_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
           torch.float16: "float16"}
_INT64_MAX = 2**63 - 1


def kind(obj: Any) -> str:
    return type(obj).__name__


class Fields:
    """The fields of one config object, each to be read (take) or checked (require) once; done()
    refuses the fields no one read."""

    def __init__(self, obj: Any, where: str):
        self.where = f"{where} ({kind(obj)})"
        if dataclasses.is_dataclass(obj):
            self.values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        else:
            self.values = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        self.read: set[str] = set()

    def take(self, name: str, default: Any) -> Any:
        self.read.add(name)
        return self.values.get(name, default)

    def require(self, name: str, allowed: Any, why: str) -> None:
        """The field, when present, must equal `allowed` (or pass it, when callable)."""
        value = self.take(name, allowed)
        ok = allowed(value) if callable(allowed) else value == allowed
        if not ok:
            raise ValueError(f"{self.where}: {name}={value!r} is not supported: {why}")

    def done(self) -> None:
        unknown = sorted(set(self.values) - self.read)
        if unknown:
            raise ValueError(f"{self.where}: field(s) {', '.join(unknown)} not supported by "
                             "distributed_shampoo_cpp")


def unsupported(where: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{where}={value!r} is not supported: {why}")


def dtype_name(value: Any, where: str) -> str:
    if value not in _DTYPES:
        raise unsupported(where, value, "use torch.float32 or torch.float64")
    return _DTYPES[value]


def _is_default_fn(value: Any) -> bool:
    return getattr(value, "__name__", "") in ("_default_scale_fn", "_default_scale_by_dims_fn")


# ---- diagonal families (main preconditioner or grafting) -------------------------------------------
def diagonal(config: Any, where: str) -> dict | None:
    """SGD, AdaGrad, RMSprop and Adam configs; None for another kind."""
    name = kind(config)
    names = {"SGDPreconditionerConfig": "sgd", "SGDGraftingConfig": "sgd",
             "AdaGradPreconditionerConfig": "adagrad", "AdaGradGraftingConfig": "adagrad",
             "RMSpropPreconditionerConfig": "rmsprop", "RMSpropGraftingConfig": "rmsprop",
             "AdamPreconditionerConfig": "adam", "AdamGraftingConfig": "adam"}
    if name not in names:
        return None
    fields = Fields(config, where)
    out = {"kind": names[name]}
    if out["kind"] != "sgd":
        out["epsilon"] = float(fields.take("epsilon", 1e-10))
    if out["kind"] in ("rmsprop", "adam"):
        out["beta2"] = float(fields.take("beta2", 0.999 if out["kind"] == "adam" else 0.99))
        out["drop_weighting_factor_on_gsquare"] = bool(
            fields.take("drop_weighting_factor_on_gsquare", False))
    fields.done()
    return out


def grafting(config: Any) -> dict | None:
    if config is None:
        return None
    out = diagonal(config, "grafting_config")
    if out is None:
        raise unsupported("grafting_config", config,
                          "grafting takes SGD, AdaGrad, RMSprop or Adam configs (or None)")
    return out


# ---- Shampoo families -----------------------------------------------------------------------------
def rank_deficient(config: Any, where: str) -> dict:
    fields = Fields(config, where)
    if kind(config) == "PerturbationConfig":
        fields.require("perturb_before_computation", True,
                       "the engine perturbs before the computation")
        fields.done()
        return {"kind": "perturbation"}
    if kind(config) == "PseudoInverseConfig":
        rtol = fields.take("rank_rtol", 0.0)
        out = {"kind": "pseudo_inverse", "rank_atol": float(fields.take("rank_atol", 0.0)),
               "rank_rtol": -1.0 if rtol is None else float(rtol)}
        fields.done()
        return out
    raise unsupported(where, config, "use PerturbationConfig or PseudoInverseConfig")


def eigendecomposition(config: Any, where: str) -> dict:
    """EighEigendecompositionConfig, EigenConfig or QREigendecompositionConfig."""
    fields = Fields(config, where)
    out = {"rank_deficient": rank_deficient(
        fields.take("rank_deficient_stability_config", _perturbation()),
        where + ".rank_deficient_stability_config")}
    fields.require("tolerance", 0.0, "the engine recomputes at every amortized step")
    if kind(config) == "QREigendecompositionConfig":
        fields.require("max_iterations", 1, "the engine takes one QR step per amortized step")
        out.update(eigenbasis_method="qr", retry_double_precision=True)
    elif kind(config) in ("EighEigendecompositionConfig", "EigenConfig"):
        out.update(eigenbasis_method="eigh",
                   retry_double_precision=bool(fields.take("retry_double_precision", True)))
        fields.require("eigendecomposition_offload_device", "",
                       "the decomposition runs on the parameters' device")
    else:
        raise unsupported(where, config, "use EighEigendecompositionConfig, EigenConfig or "
                                         "QREigendecompositionConfig")
    fields.done()
    return out


def _perturbation():
    from distributed_shampoo_cpp._configs import PerturbationConfig
    return PerturbationConfig()


def root_inv(config: Any, where: str) -> dict:
    """RootInvConfig (EigenConfig, CoupledNewtonConfig, CoupledHigherOrderConfig,
    NewtonSchulzRootInvConfig) as the engine's root solver."""
    if kind(config) == "EigenConfig":
        out = eigendecomposition(config, where)
        if out.pop("eigenbasis_method") != "eigh":
            raise unsupported(where, config, "EigenConfig only")
        return {**out, "solver": "eigh", "max_iterations": 100, "tolerance": 1e-6}
    if kind(config) == "CoupledNewtonConfig":
        fields = Fields(config, where)
        out = {"solver": "coupled_newton", "retry_double_precision": True,
               "max_iterations": int(fields.take("max_iterations", 100)),
               "tolerance": float(fields.take("tolerance", 1e-6)),
               "rank_deficient": {"kind": "perturbation"}}
        fields.done()
        return out
    if kind(config) == "CoupledHigherOrderConfig":
        fields = Fields(config, where)
        out = {"solver": "coupled_higher_order", "retry_double_precision": True,
               "rel_epsilon": float(fields.take("rel_epsilon", None)),
               "abs_epsilon": float(fields.take("abs_epsilon", None)),
               "max_iterations": int(fields.take("max_iterations", 100)),
               "tolerance": float(fields.take("tolerance", 1e-8)),
               "order": int(fields.take("order", 3)),
               "rank_deficient": {"kind": "perturbation"}}
        # The engine never uses TF32 here unless asked (tf32 is not the reference's field).
        fields.require("disable_tf32", True, "TF32 products are not offered for this solver")
        fields.done()
        return out
    if kind(config) == "NewtonSchulzRootInvConfig":
        fields = Fields(config, where)
        coefficients = fields.take("coefficients", None)
        out = {"solver": "newton_schulz", "retry_double_precision": True,
               "relative_epsilon": float(fields.take("relative_epsilon", 1e-6)),
               "max_iterations": 100, "tolerance": 1e-6,
               "rank_deficient": {"kind": "perturbation"}}
        if coefficients is not None:
            out["coefficients"] = [[float(x) for x in triple] for triple in coefficients]
        fields.require("disable_tf32", True, "TF32 products are not offered for this solver")
        fields.done()
        return out
    raise unsupported(where, config, "root-inverse Shampoo takes EigenConfig, "
                                     "CoupledNewtonConfig, CoupledHigherOrderConfig or "
                                     "NewtonSchulzRootInvConfig")


def exponent_override(value: Any, where: str) -> dict:
    """{order: {dim: e} | e} -> {order: {dim (-1 = every dim): e}}."""
    out = {}
    for order, spec in dict(value or {}).items():
        if isinstance(spec, dict):
            out[int(order)] = {int(d): float(e) for d, e in spec.items()}
        else:
            out[int(order)] = {-1: float(spec)}
    return out


def shampoo_common(fields: Fields, out: dict) -> None:
    """The fields every Shampoo family shares, into the option dictionary `out`."""
    out["factor_matrix_dtype"] = dtype_name(fields.take("factor_matrix_dtype", torch.float32),
                                            fields.where + ".factor_matrix_dtype")
    out["num_tolerated_failed_amortized_computations"] = int(
        fields.take("num_tolerated_failed_amortized_computations", 3))
    out["use_symmetric_packing"] = bool(fields.take("use_symmetric_packing", True))
    fields.require("drop_weighting_factor_on_gsquare", False, "not offered for Kronecker factors")
    out["use_trace_scaling"] = bool(fields.take("use_trace_scaling", False))
    out["trace_scaling_exponent"] = float(fields.take("trace_scaling_exponent", 0.5))


def same_dtype(fields: Fields, name: str, out: dict) -> None:
    """A dtype field the engine keeps equal to factor_matrix_dtype."""
    value = fields.take(name, torch.float32)
    if dtype_name(value, f"{fields.where}.{name}") != out["factor_matrix_dtype"]:
        raise unsupported(f"{fields.where}.{name}", value,
                          "the engine keeps it in factor_matrix_dtype "
                          f"({out['factor_matrix_dtype']})")


def shampoo_family(config: Any, out: dict) -> dict:
    """A Shampoo-family config: its preconditioner dictionary; its shared fields go into `out`."""
    name = kind(config)
    where = "preconditioner_config"
    fields = Fields(config, where)
    shampoo_common(fields, out)
    amortized = fields.take("amortized_computation_config", None)
    amortized_where = where + ".amortized_computation_config"
    if name in ("RootInvShampooPreconditionerConfig", "RootInvKLShampooPreconditionerConfig"):
        from distributed_shampoo_cpp._configs import EigenConfig
        precond = root_inv(amortized if amortized is not None else EigenConfig(), amortized_where)
        precond["kind"] = "root_inv_kl" if "KL" in name else "root_inv"
        same_dtype(fields, "inv_factor_matrix_dtype", out)
    elif name in ("EigendecomposedShampooPreconditionerConfig",
                  "EigendecomposedKLShampooPreconditionerConfig"):
        precond = eigendecomposition(amortized or _eigh(), amortized_where)
        precond["kind"] = "eigendecomposed_kl" if "KL" in name else "eigendecomposed"
        same_dtype(fields, "factor_matrix_eigenvectors_dtype", out)
        same_dtype(fields, "factor_matrix_eigenvalues_dtype", out)
    else:  # EigenvalueCorrectedShampooPreconditionerConfig
        precond = eigendecomposition(amortized or _eigh(), amortized_where)
        if precond.pop("rank_deficient")["kind"] != "perturbation":
            raise unsupported(amortized_where, amortized, "SOAP takes PerturbationConfig only")
        precond["kind"] = "eigenvalue_corrected"
        precond["ignored_basis_change_dims"] = ignored_dims(
            fields.take("ignored_basis_change_dims", {}), where + ".ignored_basis_change_dims")
        same_dtype(fields, "factor_matrix_eigenvectors_dtype", out)
        same_dtype(fields, "corrected_eigenvalues_dtype", out)
    override = fields.take("inverse_exponent_override", {})
    if override and name.startswith("EigenvalueCorrected"):
        raise unsupported(where + ".inverse_exponent_override", override, "not for SOAP")
    out["inverse_exponent_override"] = exponent_override(override, where)
    fields.done()
    return precond


def ignored_dims(value: Any, where: str) -> dict:
    """{order: [dims]} with int keys and int lists (the engine checks the ranges)."""
    if not isinstance(value, dict):
        raise unsupported(where, value, "a dict {block order: [dims]}")
    return {int(order): [int(d) for d in dims] for order, dims in value.items()}


def _eigh():
    from distributed_shampoo_cpp._configs import EighEigendecompositionConfig
    return EighEigendecompositionConfig()


SHAMPOO_FAMILIES = ("RootInvShampooPreconditionerConfig", "RootInvKLShampooPreconditionerConfig",
                    "EigendecomposedShampooPreconditionerConfig",
                    "EigendecomposedKLShampooPreconditionerConfig",
                    "EigenvalueCorrectedShampooPreconditionerConfig")


def descent(config: Any) -> dict | None:
    """Spectral and sign descent; None for another kind."""
    where = "preconditioner_config"
    fields = Fields(config, where)
    if kind(config) == "SignDescentPreconditionerConfig":
        fields.require("scale_fn", _is_default_fn, "only the default scale (1)")
        fields.done()
        return {"kind": "sign_descent"}
    if kind(config) != "SpectralDescentPreconditionerConfig":
        return None
    ortho = fields.take("orthogonalization_config", None)
    fields.done()
    out = {"kind": "spectral_descent", "method": "newton_schulz", "num_iterations": 5,
           "coefficients": [3.4445, -4.7750, 2.0315], "scale_by_nuclear_norm": False}
    if ortho is None:
        return out
    ofields = Fields(ortho, where + ".orthogonalization_config")
    ofields.require("scale_by_dims_fn", _is_default_fn, "only the default scale (1)")
    if kind(ortho) == "SVDOrthogonalizationConfig":
        out.update(method="svd",
                   scale_by_nuclear_norm=bool(ofields.take("scale_by_nuclear_norm", False)))
    else:
        out.update(num_iterations=int(ofields.take("num_iterations", 5)),
                   coefficients=[float(c) for c in ofields.take("coefficients", out["coefficients"])])
    ofields.done()
    return out


def preconditioner(config: Any, out: dict) -> dict:
    if kind(config) in SHAMPOO_FAMILIES:
        return shampoo_family(config, out)
    found = diagonal(config, "preconditioner_config") or descent(config)
    if found is None:
        raise unsupported("preconditioner_config", config, "not a preconditioner config this "
                                                           "package knows")
    return found


# ---- iterate averaging, weight decay, the whole group ---------------------------------------------
def averaging(config: Any, out: dict) -> None:
    """iterate_averaging_config: momentum fields or the averaging dictionary, into `out`."""
    out.update(momentum=0.0, dampening=0.0, use_nesterov=False, iterate_averaging=None)
    if config is None:
        return
    fields = Fields(config, "iterate_averaging_config")
    if kind(config) == "ClassicMomentumConfig":
        out.update(momentum=float(fields.take("momentum", 0.5)),
                   dampening=float(fields.take("dampening", 0.0)),
                   use_nesterov=bool(fields.take("use_nesterov", False)))
    elif kind(config) == "GeneralizedPrimalAveragingConfig":
        out["iterate_averaging"] = {
            "kind": "gpa", "eval_interp_coeff": float(fields.take("eval_interp_coeff", 0.9)),
            "train_interp_coeff": float(fields.take("train_interp_coeff", 0.8))}
    elif kind(config) == "ScheduleFreeConfig":
        out["iterate_averaging"] = {
            "kind": "schedule_free",
            "train_interp_coeff": float(fields.take("train_interp_coeff", 0.8)),
            "eval_coeff_lr_power": float(fields.take("eval_coeff_lr_power", 2))}
    else:
        raise unsupported("iterate_averaging_config", config, "use ClassicMomentumConfig, "
                          "GeneralizedPrimalAveragingConfig or ScheduleFreeConfig")
    fields.done()


def weight_decay_type(value: Any) -> str:
    name = value.name if isinstance(value, enum.Enum) else str(value)
    if name not in ("L2", "DECOUPLED", "CORRECTED", "INDEPENDENT"):
        raise unsupported("weight_decay_type", value, "L2, DECOUPLED, CORRECTED or INDEPENDENT")
    return name


def engine_peak_lr(value: Any) -> float:
    """A group's peak_lr for the engine: the value when > 0, else -1 (the engine then takes the
    group's lr, and refuses CORRECTED and INDEPENDENT decay if that is 0)."""
    value = float(value)
    return value if value > 0 else -1.0


def max_dim(value: Any, where: str) -> int:
    """An integer ≥ 1, or math.inf (no limit)."""
    if isinstance(value, float):
        if value != math.inf:
            raise unsupported(where, value, "an integer or math.inf")
        return _INT64_MAX
    return int(value)


def step_number(value: Any, where: str) -> int:
    """An integer step, or math.inf (never: the reference's way to keep preconditioning off)."""
    if isinstance(value, float):
        if value != math.inf:
            raise unsupported(where, value, "an integer or math.inf")
        return _INT64_MAX
    return int(value)


FLOAT_KEYS = ("lr", "betas", "beta3", "epsilon", "weight_decay", "peak_lr")


def engine_options(group: dict) -> dict:
    """The C++ option dictionary of one param group (its Python keys, reference names)."""
    beta1, beta2 = group["betas"]
    out = {"lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
           "beta3": float(group["beta3"]), "epsilon": float(group["epsilon"]),
           "weight_decay": float(group["weight_decay"]),
           "weight_decay_type": weight_decay_type(group["weight_decay_type"]),
           "peak_lr": engine_peak_lr(group["peak_lr"]),
           "max_preconditioner_dim": max_dim(group["max_preconditioner_dim"],
                                             "max_preconditioner_dim"),
           "precondition_frequency": int(group["precondition_frequency"]),
           "start_preconditioning_step": step_number(group["start_preconditioning_step"],
                                                     "start_preconditioning_step"),
           "use_bias_correction": bool(group["use_bias_correction"]),
           "relative_epsilon": float(group["relative_epsilon"]),
           "use_merge_dims": bool(group["use_merge_dims"]),
           "precondition_1d": bool(group["precondition_1d"]),
           "max_factored_dim": int(group["max_factored_dim"]),
           "factored_grafting": bool(group["factored_grafting"]),
           "compact_state": str(group["compact_state"]),
           "grafting": grafting(group["grafting_config"]),
           # Defaults for the families that have no factors; shampoo_family overwrites them.
           "factor_matrix_dtype": "float32", "num_tolerated_failed_amortized_computations": 3,
           "use_symmetric_packing": True, "inverse_exponent_override": {},
           "use_trace_scaling": False, "trace_scaling_exponent": 0.5}
    out["preconditioner"] = preconditioner(group["preconditioner_config"], out)
    averaging(group["iterate_averaging_config"], out)
    return out


def distributed(config: Any) -> tuple[dict, Any, str]:
    """(the engine's distributed options, the process group or None, the mode: "single", "ddp"
    or "fully_shard")."""
    out = {"communication_dtype": "float32", "num_trainers_per_group": -1,
           "communicate_params": False, "merge_param_groups": True}
    if config is None or kind(config) == "SingleDeviceDistributedConfig":
        if config is not None:
            Fields(config, "distributed_config").take("target_parameter_dimensionality", 1)
        return out, None, "single"
    if kind(config) == "FullyShardDistributedConfig":
        fields = Fields(config, "distributed_config")
        fields.require("target_parameter_dimensionality", 1, "the engine blocks every parameter")
        fields.require("param_assignment_strategy",
                       lambda v: getattr(v, "name", v) == "DEFAULT",
                       "each rank steps its own shards (DEFAULT); REPLICATE and ROUND_ROBIN are "
                       "not supported")
        fields.require("num_sub_groups", 1, "one pass over every group")
        load_balancing(fields)
        fields.done()
        return out, None, "fully_shard"
    if kind(config) != "DDPDistributedConfig":
        raise unsupported("distributed_config", config,
                          "SingleDeviceDistributedConfig, DDPDistributedConfig and "
                          "FullyShardDistributedConfig are supported; FSDP (version 1), HSDP and "
                          "hybrid shard configs are not (yet)")
    fields = Fields(config, "distributed_config")
    fields.require("target_parameter_dimensionality", 1, "the engine blocks every parameter")
    out["communication_dtype"] = dtype_name(fields.take("communication_dtype", torch.float32),
                                            "distributed_config.communication_dtype")
    out["num_trainers_per_group"] = int(fields.take("num_trainers_per_group", -1))
    out["communicate_params"] = bool(fields.take("communicate_params", False))
    load_balancing(fields)
    group = fields.take("process_group", None)
    fields.done()
    return out, group, "ddp"


def load_balancing(fields: Fields) -> None:
    balancing = fields.take("load_balancing_config", None)
    if balancing is not None and kind(getattr(balancing, "cost_model", None)) not in (
            "AlignedMemoryCostModel", "NoneType"):
        raise unsupported("distributed_config.load_balancing_config", balancing,
                          "the engine balances blocks by its own cost model")
