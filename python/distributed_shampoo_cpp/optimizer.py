"""DistributedShampoo as a torch.optim.Optimizer: the reference's constructor over the C++ engine.

The Python layer translates and keeps PyTorch's conventions (param_groups, state, state_dict,
hooks); the step itself runs in C++ (shampoo::DistributedShampoo) on the same tensors, without
the GIL. docs/python.md says what maps to what.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from distributed_shampoo_cpp import _C, _translate
from distributed_shampoo_cpp._configs import (
    DefaultShampooConfig,
    DefaultSingleDeviceDistributedConfig,
    WeightDecayType,
)

# Keys of a param group that hold configuration objects or enums: translated into the plain
# "engine_options" entry of state_dict() (so that torch.load's weights_only default reads it).
_CONFIG_KEYS = ("weight_decay_type", "iterate_averaging_config", "grafting_config",
                "preconditioner_config")
# The group keys that are structural: fixed after construction (a change is an error).
_STRUCTURAL_KEYS = _CONFIG_KEYS + (
    "max_preconditioner_dim", "precondition_frequency", "start_preconditioning_step",
    "use_bias_correction", "relative_epsilon", "precondition_1d", "max_factored_dim",
    "factored_grafting", "use_merge_dims", "compact_state")


class DistributedShampoo(torch.optim.Optimizer):
    """Distributed Shampoo with the reference implementation's constructor and defaults.

    The keyword arguments up to `concurrency_config` are the reference's (facebookresearch/
    optimizers, `distributed_shampoo.DistributedShampoo`), with its defaults; config objects may
    be this package's classes or the reference's own. The keyword-only arguments after them are
    this engine's options, at the values that give the reference's behaviour:
      relative_epsilon: relative regularization of root-inverse Shampoo's factors (0: none);
      precondition_1d: Kronecker factors for 1-D parameters (the reference: yes);
      max_factored_dim: a dim above this keeps no factor (-1: no limit);
      factored_grafting: grafting's second moment as row and column sums on factored blocks;
      use_merge_dims: merge small trailing dims up to max_preconditioner_dim;
      compact_state: "none", "bfloat16" or "int8";
      merge_param_groups: fold groups that differ only in floats into one virtual group.
    Float hyperparameters (lr, betas, beta3, epsilon, weight_decay) may be changed in
    param_groups at any time (LR schedulers do); the next step() follows them. Other keys are
    fixed after construction.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        beta3: float = -1.0,
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        weight_decay_type: Any = WeightDecayType.DECOUPLED,
        max_preconditioner_dim: int | float = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = -1,
        use_bias_correction: bool = True,
        iterate_averaging_config: Any = None,
        grafting_config: Any = None,
        use_pin_memory: bool = False,
        shampoo_pt2_compile_config: Any = None,
        distributed_config: Any = DefaultSingleDeviceDistributedConfig,
        preconditioner_config: Any = DefaultShampooConfig,
        shampoo_runtime_config: Any = None,
        concurrency_config: Any = None,
        *,
        relative_epsilon: float = 0.0,
        precondition_1d: bool = True,
        max_factored_dim: int = -1,
        factored_grafting: bool = False,
        use_merge_dims: bool = True,
        compact_state: str = "none",
        merge_param_groups: bool = True,
    ) -> None:
        if shampoo_pt2_compile_config is not None and \
                _translate.kind(shampoo_pt2_compile_config) != "ShampooPT2CompileConfig":
            raise _translate.unsupported("shampoo_pt2_compile_config", shampoo_pt2_compile_config,
                                         "pass None or a ShampooPT2CompileConfig")
        # use_pin_memory, shampoo_pt2_compile_config, shampoo_runtime_config (eager_nan_check)
        # and concurrency_config are accepted for compatibility: the step is C++ (nothing to
        # compile), the engine always checks gradients for non-finite values, keeps its state
        # where the parameters are, and steps all groups in one pass.
        self._engine = None
        defaults = dict(
            lr=lr, betas=tuple(betas), beta3=beta3, epsilon=epsilon, weight_decay=weight_decay,
            # As the reference: CORRECTED and INDEPENDENT divide by the constructor's lr, which a
            # scheduler does not change (a group may give its own peak_lr).
            peak_lr=lr, weight_decay_type=weight_decay_type, max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            use_bias_correction=use_bias_correction,
            iterate_averaging_config=iterate_averaging_config, grafting_config=grafting_config,
            preconditioner_config=preconditioner_config, relative_epsilon=relative_epsilon,
            precondition_1d=precondition_1d, max_factored_dim=max_factored_dim,
            factored_grafting=factored_grafting, use_merge_dims=use_merge_dims,
            compact_state=compact_state)
        super().__init__(params, defaults)
        options, group, mode = _translate.distributed(distributed_config)
        options["merge_param_groups"] = bool(merge_param_groups)
        if mode == "ddp":
            group = self._checked_process_group(group)
        self._distributed_config = distributed_config
        # Each rank of a DDP or FSDP2 run keeps other state: its state_dict() keys carry the
        # rank, so that torch.distributed.checkpoint (which keeps one value per key) saves every
        # rank's and loads each its own.
        self._rank_key = _rank_key(mode)
        # FullyShardDistributedConfig: the engine steps each rank's local shards (DTensor
        # parameters' local tensors); their gradients are handed over at each step.
        self._shards: list[tuple[torch.Tensor, torch.Tensor]] | None = (
            [] if mode == "fully_shard" else None)
        specs = [(self._engine_params(g, i), self._options_of(g, i))
                 for i, g in enumerate(self.param_groups)]
        self._engine = _engine_call(lambda: _C.Engine(specs, options, group), "DistributedShampoo")
        self._floats: list[tuple] = []
        self._structure: list[tuple] = []
        self._step_tensors: list[torch.Tensor] = []
        for g in self.param_groups:
            self._remember(g)

    # ---- construction -------------------------------------------------------------------------
    def _checked_process_group(self, group: Any) -> Any:
        if group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("DDPDistributedConfig: torch.distributed is not initialized; call "
                                 "torch.distributed.init_process_group first (torchrun sets the "
                                 "environment), or pass DDPDistributedConfig(process_group=...)")
            group = dist.group.WORLD
        devices = {p.device.type for g in self.param_groups for p in g["params"]}
        for device in devices:
            try:
                group._get_backend(torch.device(device))
            except Exception as error:
                raise ValueError(
                    f"DDPDistributedConfig: the process group has no backend for {device} tensors "
                    f"({error}); for CPU parameters pass a Gloo group, e.g. "
                    "DDPDistributedConfig(process_group=torch.distributed.new_group("
                    "backend='gloo')), or init_process_group(backend='cpu:gloo,cuda:nccl')"
                ) from None
        return group

    def _engine_params(self, group: dict, index: int) -> list[torch.Tensor]:
        """The tensors the engine steps for a group: its parameters, or their local shards."""
        if self._shards is None:
            return list(group["params"])
        locals_ = []
        for j, p in enumerate(group["params"]):
            if not hasattr(p, "to_local"):
                raise ValueError(f"FullyShardDistributedConfig: parameter {j} of param group "
                                 f"{index} is not a DTensor: apply "
                                 "torch.distributed.fsdp.fully_shard to the model first")
            with torch.no_grad():
                local = p.to_local()
            # A parameter with fewer rows than ranks leaves some ranks an empty shard: the
            # engine keeps no blocks for it there, as the reference's FullyShardDistributor.
            self._shards.append((p, local))
            locals_.append(local)
        return locals_

    def _options_of(self, group: dict, index: int) -> dict:
        try:
            return _translate.engine_options(group)
        except ValueError as error:
            raise ValueError(f"param group {index}: {error}") from None

    def _remember(self, group: dict) -> None:
        """Caches a group's floats and structure, and gives its parameters their state entry."""
        self._floats.append(_floats_of(group))
        self._structure.append(_structure_of(group))
        index = len(self._step_tensors)
        step = torch.tensor(float(self._engine.group_step(index)))
        self._step_tensors.append(step)
        for p in group["params"]:
            self.state[p] = {"step": step}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self._engine is None:  # called by torch.optim.Optimizer.__init__
            return
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        try:
            options = self._options_of(group, index)
            params = self._engine_params(group, index)
            _engine_call(lambda: self._engine.add_param_group(params, options), "add_param_group")
        except Exception:
            self.param_groups.pop()
            raise
        self._remember(group)

    # ---- stepping -----------------------------------------------------------------------------
    def _sync_groups(self) -> None:
        """Pushes changed float hyperparameters; refuses changed structure."""
        groups = self.param_groups
        if len(groups) != len(self._floats):
            raise RuntimeError(f"DistributedShampoo: param_groups has {len(groups)} groups, the "
                               f"optimizer {len(self._floats)}; add groups with add_param_group")
        for i, group in enumerate(groups):
            floats = _floats_of(group)
            if floats != self._floats[i]:
                _check_floats(floats, i)
                self._engine.set_floats(i, *floats)
                self._floats[i] = floats
            structure = _structure_of(group)
            if structure != self._structure[i]:
                _raise_structure_changed(i, self._structure[i], structure)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_groups()
        if self._shards is None:
            self._engine.step()
        else:
            self._step_shards()
        for i, tensor in enumerate(self._step_tensors):
            tensor.fill_(float(self._engine.group_step(i)))
        return loss

    def _step_shards(self) -> None:
        """FSDP2: the local shards take their DTensor gradients' local tensors for the step."""
        try:
            for p, local in self._shards:
                local.grad = None if p.grad is None else p.grad.to_local()
            self._engine.step()
        finally:
            for _, local in self._shards:
                local.grad = None

    def train(self) -> None:
        """Iterate averaging: the parameters back to the training sequence (see eval())."""
        self._engine.train()

    def eval(self) -> None:
        """Iterate averaging (GeneralizedPrimalAveragingConfig, ScheduleFreeConfig): moves the
        parameters to the averaged sequence for evaluation; train() moves them back."""
        self._engine.eval()

    def is_training(self) -> bool:
        return self._engine.is_training()

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """PyTorch's layout: {"state": {index: {...}}, "param_groups": [...]}. A parameter's
        entry holds its group's "step" and the pieces of its state this rank keeps, each a
        StatePiece (a uint8 tensor; "optimizer", "block_<k>"; under DDP or FSDP2 at world > 1
        "rank<r>of<w>/block_<k>").
        Config objects are stored as plain values ("engine_options"), so that
        torch.load(weights_only=True) reads the file."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        pieces = self._engine.state_pieces()
        state, groups, index = {}, [], 0
        for g, group in enumerate(self.param_groups):
            # Config objects as text: torch.load(weights_only=True) reads plain values only, and
            # flatten_optimizer_state_dict asks for every key of the live groups.
            packed = {k: (_config_text(v) if k in _CONFIG_KEYS else v)
                      for k, v in group.items() if k != "params"}
            packed["engine_options"] = self._options_of(group, g)
            packed["params"] = list(range(index, index + len(group["params"])))
            for i, p in zip(packed["params"], group["params"]):
                state[i] = {"step": self._step_tensors[g].clone(),
                            **{self._rank_key + k: v.as_subclass(StatePiece)
                               for k, v in pieces[i].items()}}
                # The names of the pieces, in self.state too: flatten_optimizer_state_dict
                # rebuilds a loaded entry from the names there (the values stay empty).
                self.state[p] = {"step": self._step_tensors[g],
                                 **{k: _EMPTY_PIECE for k in state[i] if k != "step"}}
            index += len(group["params"])
            groups.append(packed)
        result = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            returned = hook(self, result)
            if returned is not None:
                result = returned
        return result

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads what state_dict() returned for the same parameters and structural options (at
        the same world size and rank under DDPDistributedConfig); the groups' float
        hyperparameters and other keys (e.g. a scheduler's initial_lr) come from it. Nothing
        changes unless every piece reads and checks."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: the state_dict has {len(saved_groups)} param "
                             f"groups, this optimizer {len(self.param_groups)}")
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            _check_saved_group(g, saved, group, self._options_of(group, g))
        # The saved groups list their parameters by the keys of "state": indices in PyTorch's
        # layout, names after torch.distributed.checkpoint's get/set_optimizer_state_dict.
        keys = [key for saved in saved_groups for key in saved["params"]]
        state = state_dict["state"]
        pieces = [_engine_pieces(_entry_of(state, key), self._rank_key) for key in keys]
        if keys and not any(pieces):
            raise ValueError(
                "load_state_dict: the state_dict holds no state pieces (every parameter has "
                "one). A flattened state_dict (flatten_optimizer_state_dict=True) is rebuilt from "
                "the names in optimizer.state, which state_dict() puts there: call "
                "get_optimizer_state_dict (or state_dict()) on this optimizer first, as DCP "
                "recipes do to make the state_dict to load into")
        _engine_call(lambda: self._engine.load_state_pieces(pieces), "load_state_dict")
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key not in ("params", "engine_options") and key not in _CONFIG_KEYS:
                    group[key] = tuple(value) if key == "betas" else value
        self._sync_groups()
        for i, tensor in enumerate(self._step_tensors):
            tensor.fill_(float(self._engine.group_step(i)))
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def save_distributed_checkpoint(self, directory: str) -> None:
        """A checkpoint directory that loads at any world size (every rank calls it)."""
        self._sync_groups()
        self._engine.save_checkpoint(str(directory))

    def load_distributed_checkpoint(self, directory: str) -> None:
        self._engine.load_checkpoint(str(directory))

    # ---- introspection ------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters of the engine: virtual_groups, collectives_last_step, amortized
        computations, state_bytes, bytes sent and received per step."""
        return self._engine.stats()

    def memory_summary(self) -> dict:
        """Bytes of optimizer state on this rank, by kind."""
        return self._engine.memory_summary()


class StatePiece(torch.Tensor):
    """A piece of the engine's serialized state in state_dict(): a 1-D uint8 tensor (torch.save,
    torch.equal, flatten_optimizer_state_dict and the like take it as one) that
    torch.distributed.checkpoint saves as one object, not as a tensor. Its length changes as the
    state fills, and DCP loads a tensor only into one of the same size: a new optimizer's
    state_dict() could not take a checkpoint's. A checkpoint of it loads into any template."""

    def __deepcopy__(self, memo: dict) -> "StatePiece":
        copy = self.as_subclass(torch.Tensor).clone().as_subclass(StatePiece)
        memo[id(self)] = copy
        return copy

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        # The protocol DCP's planner asks a value for its write items (DTensor implements it).
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]


torch.serialization.add_safe_globals([StatePiece])  # torch.load(weights_only=True) reads it
_EMPTY_PIECE = torch.empty(0, dtype=torch.uint8).as_subclass(StatePiece)


def _config_text(value: Any) -> Any:
    """A config in state_dict()'s param groups: plain values as they are, others as text (a
    loaded state_dict's configs are checked through engine_options, not these)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "name", None) if isinstance(value, enum.Enum) else repr(value)


def _rank_key(mode: str) -> str:
    """The prefix of this rank's state pieces: none for one process or a replicated optimizer."""
    if mode == "single" or not (dist.is_available() and dist.is_initialized()):
        return ""
    world = dist.get_world_size()
    return f"rank{dist.get_rank()}of{world}/" if world > 1 else ""


def _entry_of(state: dict, key: Any) -> dict:
    """A parameter's saved state. torch.distributed.checkpoint.load fills tensors in place but
    sets other values (our pieces) under the key's text: after dcp.load into a state_dict() with
    PyTorch's integer keys, parameter 0's pieces are under "0" and its step under 0."""
    entry = dict(state.get(key, {}))
    if isinstance(key, int) and str(key) in state:
        entry.update(state[str(key)])
    return entry


def _engine_pieces(entry: dict, rank_key: str) -> dict[str, torch.Tensor]:
    """A parameter's saved pieces as the engine reads them (uint8 tensors under their own
    names). Takes StatePiece or plain uint8 tensors (earlier versions'), or bytes; a piece saved
    by another rank or world size is an error."""
    out = {}
    for key, value in entry.items():
        if key == "step":
            continue
        name = key
        if key.startswith("rank") and "/" in key:
            prefix, name = key.split("/", 1)
            if prefix + "/" != rank_key:
                here = rank_key[:-1] if rank_key else "one process (or a replicated optimizer)"
                raise ValueError(
                    f"load_state_dict: the state_dict holds the state of {prefix}; this optimizer "
                    f"is {here}. Each rank loads the state_dict it saved, at the same world size "
                    "(save_distributed_checkpoint loads at any)")
        if isinstance(value, (bytes, bytearray)):
            value = (torch.frombuffer(bytearray(value), dtype=torch.uint8) if value
                     else torch.empty(0, dtype=torch.uint8))
        elif isinstance(value, torch.Tensor):
            value = value.as_subclass(torch.Tensor)
        out[name] = value
    return out


def _engine_call(fn: Callable[[], Any], what: str) -> Any:
    """Runs an engine call; the library's argument errors become ValueError."""
    try:
        return fn()
    except RuntimeError as error:
        message = str(error)  # the engine's messages mostly name the class already
        raise ValueError(message if message.startswith(f"{what}: ") else f"{what}: {message}") \
            from None


def _floats_of(group: dict) -> tuple:
    beta1, beta2 = group["betas"]
    return (float(group["lr"]), float(beta1), float(beta2), float(group["beta3"]),
            float(group["epsilon"]), float(group["weight_decay"]),
            _translate.engine_peak_lr(group["peak_lr"]))


def _check_floats(floats: tuple, index: int) -> None:
    lr, beta1, beta2, beta3, epsilon, weight_decay, peak_lr = floats
    checks = [("lr", lr, lr >= 0, ">= 0"), ("betas[0]", beta1, 0 <= beta1 < 1, "in [0, 1)"),
              ("betas[1]", beta2, 0 <= beta2 <= 1, "in [0, 1]"),
              ("beta3", beta3, beta3 == -1 or 0 <= beta3 < 1, "-1 or in [0, 1)"),
              ("epsilon", epsilon, epsilon >= 0, ">= 0"),
              ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
              ("peak_lr", peak_lr, peak_lr == -1 or peak_lr > 0, "> 0")]
    for name, value, ok, allowed in checks:
        if not (ok and math.isfinite(value)):
            raise ValueError(f"param group {index}: {name}={value!r}; must be {allowed}")


def _structure_of(group: dict) -> tuple:
    return (len(group["params"]),) + tuple(group.get(k) for k in _STRUCTURAL_KEYS)


def _raise_structure_changed(index: int, before: tuple, now: tuple) -> None:
    names = ("number of params",) + _STRUCTURAL_KEYS
    for name, a, b in zip(names, before, now):
        if a != b:
            raise ValueError(f"param group {index}: {name} changed from {a!r} to {b!r}; only lr, "
                             "betas, beta3, epsilon, weight_decay and peak_lr may change after "
                             "construction (build a new optimizer for another structure)")


def _check_saved_group(index: int, saved: dict, group: dict, options: dict) -> None:
    if len(saved["params"]) != len(group["params"]):
        raise ValueError(f"load_state_dict: param group {index} has {len(saved['params'])} "
                         f"parameters in the state_dict, {len(group['params'])} here")
    saved_options = saved.get("engine_options")
    if saved_options is None and all(k in saved for k in _STRUCTURAL_KEYS):
        # flatten_optimizer_state_dict keeps the live groups' keys only: check those.
        for key in _STRUCTURAL_KEYS:
            here = _config_text(group[key]) if key in _CONFIG_KEYS else group[key]
            if saved[key] != here:
                raise ValueError(f"load_state_dict: param group {index}: {key} is "
                                 f"{saved[key]!r} in the state_dict, {here!r} here")
        return
    if saved_options is None:
        raise ValueError(f"load_state_dict: param group {index} has no engine_options (a "
                         "state_dict of another optimizer?)")
    floats = ("lr", "beta1", "beta2", "beta3", "epsilon", "weight_decay", "peak_lr")
    for key, value in options.items():
        if key not in floats and saved_options.get(key) != value:
            raise ValueError(f"load_state_dict: param group {index}: {key} is "
                             f"{saved_options.get(key)!r} in the state_dict, {value!r} here")
