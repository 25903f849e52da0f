"""Distributed Shampoo for LibTorch, from Python: the C++ engine as a torch.optim.Optimizer.

    import distributed_shampoo_cpp as distributed_shampoo   # was: import distributed_shampoo
    optimizer = distributed_shampoo.DistributedShampoo(model.parameters(), lr=1e-3, ...)

The constructor, defaults and config classes are the reference implementation's
(facebookresearch/optimizers); docs/python.md says what is supported.
"""

import torch

from distributed_shampoo_cpp._build_info import TORCH_VERSION as _BUILT_FOR


def _check_torch() -> None:
    """Before the extension is loaded: one built against another torch would fail to load with
    an undefined symbol."""
    found = torch.__version__.split("+")[0]
    if found != _BUILT_FOR:
        raise ImportError(
            f"distributed_shampoo_cpp was built against torch {_BUILT_FOR}, but torch "
            f"{torch.__version__} is imported; rebuild it against this torch "
            f"(pip install --no-build-isolation .) or install torch=={_BUILT_FOR}")


_check_torch()

from distributed_shampoo_cpp import _C  # noqa: E402

from distributed_shampoo_cpp import _configs  # noqa: E402
from distributed_shampoo_cpp.optimizer import DistributedShampoo  # noqa: E402


def _is_config(name: str, value: object) -> bool:
    """The config classes (and their aliases) and the Default* instances of _configs.py."""
    if name.startswith("_"):
        return False
    if isinstance(value, type):
        return value.__module__ == _configs.__name__
    return name.startswith("Default")


__all__ = ["DistributedShampoo"]
for _name, _value in vars(_configs).items():
    if _is_config(_name, _value):
        globals()[_name] = _value
        __all__.append(_name)
# The reference exports it for its FSDP (version 1) configs; here it says they are not supported.
compile_fsdp_parameter_metadata = _configs.compile_fsdp_parameter_metadata
__all__.append("compile_fsdp_parameter_metadata")
__version__ = "0.1.0"
