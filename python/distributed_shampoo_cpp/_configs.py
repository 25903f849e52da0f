"""The configuration classes, by the reference implementation's names and fields.

facebookresearch/optimizers' `distributed_shampoo` configures its optimizer with dataclasses
(`AdamPreconditionerConfig`, `EigenConfig`, `DDPDistributedConfig`, ...). These are this
package's own classes with the same names, fields and defaults, so that a script written for the
reference runs after changing its import. The optimizer also accepts the reference's own objects:
it reads any config by its class name and fields (`_translate.py`), without importing the
reference. A field the engine does not support is refused when the optimizer is built, by name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class WeightDecayType(enum.Enum):
    """L2: wd·W is added to the gradient; DECOUPLED: W shrinks by lr·wd after the step (AdamW);
    CORRECTED: by lr²·wd/peak_lr; INDEPENDENT: by lr·wd/peak_lr (docs/math.md, step 6)."""

    L2 = enum.auto()
    DECOUPLED = enum.auto()
    CORRECTED = enum.auto()
    INDEPENDENT = enum.auto()


# ---- the preconditioners (main, or grafting) ------------------------------------------------------
class PreconditionerConfig:
    """Base of the preconditioner configs."""


@dataclass
class SGDPreconditionerConfig(PreconditionerConfig):
    pass


@dataclass(kw_only=True)
class AdaGradPreconditionerConfig(PreconditionerConfig):
    epsilon: float = 1e-10


@dataclass(kw_only=True)
class RMSpropPreconditionerConfig(AdaGradPreconditionerConfig):
    beta2: float = 0.99
    drop_weighting_factor_on_gsquare: bool = False


@dataclass(kw_only=True)
class AdamPreconditionerConfig(RMSpropPreconditionerConfig):
    beta2: float = 0.999


# The reference's older names for the grafting configs.
SGDGraftingConfig = SGDPreconditionerConfig
AdaGradGraftingConfig = AdaGradPreconditionerConfig
RMSpropGraftingConfig = RMSpropPreconditionerConfig
AdamGraftingConfig = AdamPreconditionerConfig


# ---- matrix functions ---------------------------------------------------------------------------
class RankDeficientStabilityConfig:
    pass


@dataclass(kw_only=True)
class PerturbationConfig(RankDeficientStabilityConfig):
    perturb_before_computation: bool = True


@dataclass(kw_only=True)
class PseudoInverseConfig(RankDeficientStabilityConfig):
    rank_atol: float = 0.0
    rank_rtol: float | None = 0.0


DefaultPerturbationConfig = PerturbationConfig()


class MatrixFunctionConfig:
    pass


@dataclass(kw_only=True)
class EigendecompositionConfig(MatrixFunctionConfig):
    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=PerturbationConfig)
    tolerance: float = 0.0


@dataclass(kw_only=True)
class EighEigendecompositionConfig(EigendecompositionConfig):
    retry_double_precision: bool = True
    eigendecomposition_offload_device: str = ""


@dataclass(kw_only=True)
class QREigendecompositionConfig(EigendecompositionConfig):
    max_iterations: int = 1


class RootInvConfig(MatrixFunctionConfig):
    pass


@dataclass(kw_only=True)
class EigenConfig(RootInvConfig, EighEigendecompositionConfig):
    pass


@dataclass(kw_only=True)
class CoupledNewtonConfig(RootInvConfig):
    max_iterations: int = 100
    tolerance: float = 1e-6


@dataclass(kw_only=True)
class CoupledHigherOrderConfig(RootInvConfig):
    """The reference's coupled higher-order inverse root (docs/math.md, "Coupled higher order")."""

    rel_epsilon: float
    abs_epsilon: float
    max_iterations: int = 100
    tolerance: float = 1e-8
    order: int = 3
    disable_tf32: bool = True


def _default_newton_schulz_coefficients() -> list[list[float]]:
    # The reference's default schedule (a 10-step Polar Express schedule), the engine's default.
    from distributed_shampoo_cpp._C import default_newton_schulz_coefficients
    return [list(t) for t in default_newton_schulz_coefficients()]


@dataclass(kw_only=True)
class NewtonSchulzRootInvConfig(RootInvConfig):
    """The reference's fixed-schedule Newton-Schulz inverse root (docs/math.md#newton-schulz):
    roots that are powers of two only."""

    relative_epsilon: float = 1e-6
    disable_tf32: bool = True
    coefficients: list[list[float]] = field(default_factory=_default_newton_schulz_coefficients)


DefaultEigenConfig = EigenConfig()
DefaultEigendecompositionConfig = EighEigendecompositionConfig()


def _default_scale_by_dims_fn(d_in: int, d_out: int) -> float:
    return 1.0


class OrthogonalizationConfig(MatrixFunctionConfig):
    pass


@dataclass(kw_only=True)
class SVDOrthogonalizationConfig(OrthogonalizationConfig):
    scale_by_dims_fn: Callable[[int, int], float] = _default_scale_by_dims_fn
    scale_by_nuclear_norm: bool = False


@dataclass(kw_only=True)
class NewtonSchulzOrthogonalizationConfig(OrthogonalizationConfig):
    scale_by_dims_fn: Callable[[int, int], float] = _default_scale_by_dims_fn
    num_iterations: int = 5
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


DefaultNewtonSchulzOrthogonalizationConfig = NewtonSchulzOrthogonalizationConfig()


# ---- Shampoo families -----------------------------------------------------------------------------
@dataclass(kw_only=True)
class BaseShampooPreconditionerConfig(PreconditionerConfig):
    amortized_computation_config: MatrixFunctionConfig = field(default_factory=EigenConfig)
    drop_weighting_factor_on_gsquare: bool = False
    factor_matrix_dtype: torch.dtype = torch.float32
    num_tolerated_failed_amortized_computations: int = 3
    use_symmetric_packing: bool = True
    use_trace_scaling: bool = False
    trace_scaling_exponent: float = 0.5


@dataclass(kw_only=True)
class ClassicShampooPreconditionerConfig(BaseShampooPreconditionerConfig):
    inverse_exponent_override: dict[int, dict[int, float] | float] = field(default_factory=dict)


@dataclass(kw_only=True)
class RootInvShampooPreconditionerConfig(ClassicShampooPreconditionerConfig):
    amortized_computation_config: RootInvConfig = field(default_factory=EigenConfig)
    inv_factor_matrix_dtype: torch.dtype = torch.float32


@dataclass(kw_only=True)
class EigendecomposedShampooPreconditionerConfig(ClassicShampooPreconditionerConfig):
    amortized_computation_config: EigendecompositionConfig = field(
        default_factory=EighEigendecompositionConfig)
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    factor_matrix_eigenvalues_dtype: torch.dtype = torch.float32


@dataclass(kw_only=True)
class EigenvalueCorrectedShampooPreconditionerConfig(BaseShampooPreconditionerConfig):
    amortized_computation_config: EigendecompositionConfig = field(
        default_factory=EighEigendecompositionConfig)
    ignored_basis_change_dims: dict[int, list[int]] = field(default_factory=dict)
    inverse_exponent_override: dict[int, float] = field(default_factory=dict)
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    corrected_eigenvalues_dtype: torch.dtype = torch.float32


@dataclass(kw_only=True)
class RootInvKLShampooPreconditionerConfig(RootInvShampooPreconditionerConfig):
    pass


@dataclass(kw_only=True)
class EigendecomposedKLShampooPreconditionerConfig(EigendecomposedShampooPreconditionerConfig):
    pass


@dataclass(kw_only=True)
class SpectralDescentPreconditionerConfig(PreconditionerConfig):
    orthogonalization_config: OrthogonalizationConfig = field(
        default_factory=NewtonSchulzOrthogonalizationConfig)


def _default_scale_fn(grad: torch.Tensor) -> float:
    return 1.0


@dataclass(kw_only=True)
class SignDescentPreconditionerConfig(PreconditionerConfig):
    scale_fn: Callable[[torch.Tensor], Any] = _default_scale_fn


DefaultShampooConfig = RootInvShampooPreconditionerConfig()
DefaultEigenvalueCorrectedShampooConfig = EigenvalueCorrectedShampooPreconditionerConfig()
DefaultSOAPConfig = EigenvalueCorrectedShampooPreconditionerConfig(
    amortized_computation_config=QREigendecompositionConfig())
DefaultSpectralDescentPreconditionerConfig = SpectralDescentPreconditionerConfig()
DefaultSignDescentPreconditionerConfig = SignDescentPreconditionerConfig()


# ---- iterate averaging and momentum ---------------------------------------------------------------
class IterateAveragingConfig:
    pass


@dataclass(kw_only=True)
class ClassicMomentumConfig(IterateAveragingConfig):
    momentum: float = 0.5
    dampening: float = 0.0
    use_nesterov: bool = False


@dataclass(kw_only=True)
class GeneralizedPrimalAveragingConfig(IterateAveragingConfig):
    eval_interp_coeff: float = 0.9
    train_interp_coeff: float = 0.8


@dataclass(kw_only=True)
class ScheduleFreeConfig(IterateAveragingConfig):
    train_interp_coeff: float = 0.8
    eval_coeff_lr_power: float = 2


# ---- distribution ---------------------------------------------------------------------------------
class DistributedConfig:
    pass


@dataclass(kw_only=True)
class SingleDeviceDistributedConfig(DistributedConfig):
    target_parameter_dimensionality: int | float = 1


DefaultSingleDeviceDistributedConfig = SingleDeviceDistributedConfig()


@dataclass(kw_only=True)
class DDPDistributedConfig(DistributedConfig):
    """The reference's fields, and one of this package: `process_group`, the torch.distributed
    group to distribute over (None: the default group). It needs a CPU backend (Gloo) for CPU
    parameters and NCCL for CUDA ones."""

    target_parameter_dimensionality: int | float = 1
    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    process_group: Any = None


class FSDPParamAssignmentStrategy(enum.Enum):
    """How FSDP2's shards are preconditioned. DEFAULT (the only one supported): each rank
    preconditions the blocks of its own shards, without communication."""

    DEFAULT = enum.auto()
    REPLICATE = enum.auto()
    ROUND_ROBIN = enum.auto()


@dataclass(kw_only=True)
class FullyShardDistributedConfig(DistributedConfig):
    """A model wrapped in FSDP2 (torch.distributed.fsdp.fully_shard): each rank steps its local
    shards as parameters of their own (blocks within a shard), without communication, as the
    reference's FullyShardDistributor does."""

    target_parameter_dimensionality: int | float = 1
    param_assignment_strategy: FSDPParamAssignmentStrategy = FSDPParamAssignmentStrategy.DEFAULT
    num_sub_groups: int = 1
    load_balancing_config: Any = None


# ---- the reference's other distributed configs: importable, refused by the optimizer --------------
# A script written for the reference imports them by name; DistributedShampoo refuses them with an
# error naming the config (docs/python.md, "Not supported yet"), as it does the reference's objects.
@dataclass(kw_only=True)
class FSDPDistributedConfig(DistributedConfig):
    """FSDP version 1 (the reference's FSDPDistributor): not supported by this package."""

    target_parameter_dimensionality: int | float = 1
    param_to_metadata: dict


@dataclass(kw_only=True)
class HSDPDistributedConfig(FSDPDistributedConfig):
    """HSDP over FSDP version 1: not supported by this package."""

    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    load_balancing_config: Any = None
    device_mesh: Any


@dataclass(kw_only=True)
class HybridShardDistributedConfig(FullyShardDistributedConfig):
    """Hybrid sharding over FSDP2: not supported by this package (the engine's own hybrid
    sharding is in C++)."""

    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    device_mesh: Any


def compile_fsdp_parameter_metadata(module: Any) -> dict:
    """The reference builds FSDPDistributedConfig's param_to_metadata with it; that config is not
    supported here, so this is an error that says so."""
    raise NotImplementedError(
        "compile_fsdp_parameter_metadata: FSDPDistributedConfig and HSDPDistributedConfig (FSDP "
        "version 1) are not supported by distributed_shampoo_cpp; wrap the model in DDP and use "
        "DDPDistributedConfig, or in FSDP2 (fully_shard) and use FullyShardDistributedConfig")


def _torch_compile_fields() -> list[tuple[str, Any, Any]]:
    """torch.compile's keyword parameters but the model (the reference's ShampooPT2CompileConfig
    has exactly these fields)."""
    import inspect

    return [(name, Any, parameter.default)
            for name, parameter in inspect.signature(torch.compile).parameters.items()
            if name != "model"]


def _make_pt2_compile_config() -> type:
    from dataclasses import make_dataclass

    cls = make_dataclass("ShampooPT2CompileConfig", _torch_compile_fields(), kw_only=True)
    cls.__module__ = __name__
    cls.__doc__ = (
        "The reference's settings for torch.compile of its step. Accepted and without effect "
        "here: the step is C++ already, nothing is traced or compiled.")
    return cls


ShampooPT2CompileConfig = _make_pt2_compile_config()


@dataclass
class ShampooRuntimeConfig:
    eager_nan_check: bool = False


DefaultShampooRuntimeConfig = ShampooRuntimeConfig()


@dataclass
class ConcurrencyConfig:
    enable_cuda_stream_for_param_groups: bool = True


DefaultConcurrencyConfig = ConcurrencyConfig()
