"""The dp x sp groups each training engine wants, and the loss scale that makes its gradient right.

    from ulysses_kernels.integrations import hf, mesh

    groups = mesh.parallel_groups(sp_size=4)             # world = dp x 4, sequence partners adjacent
    hf.apply(model, groups.sp_group)
    # FSDP2: fully_shard(layer, mesh=groups.dp_sp_mesh) for each layer, then the model
    # DeepSpeed: deepspeed.initialize(model=model, config=cfg, mpu=groups.mpu())
    divisor = mesh.grad_divisor(engine_or_name, groups)  # what the engine divides the gradient sum by
    batch = hf.shard_batch(global_batch_of_this_replica, group=groups.sp_group)
    loss = mesh.scale_loss(model(**batch.model_inputs()).loss, batch.num_tokens, groups, divisor)
    loss.backward()  # (engine.backward(loss) under DeepSpeed)

Rank layout of ``parallel_groups(sp_size, dp_size)`` (torch's ``init_device_mesh`` order,
``("dp", "sp")``): global rank ``r`` is sequence rank ``r % sp`` of data replica
``r // sp``. The sequence group (an all-to-all in every attention layer) is ``sp``
consecutive ranks, inside one node's NVLink domain when ``sp`` divides the GPUs per node;
the data-parallel group (one gradient reduction per step) strides across nodes.

The gradient. One step on ``dp`` replicas, each sharded over ``sp`` ranks, must equal one
process on the whole global batch with the mean over its valid tokens. Each rank's loss is
the sum of its token losses over the global count ``N`` (``N`` summed over the replicas);
the engines then reduce the gradients over all ``dp x sp`` ranks, but divide the sum:

    engine                                             divides the sum over dp x sp by
    FSDP2 (fully_shard on the flattened dp x sp mesh)  dp x sp   (reduce-scatter mean)
    DeepSpeed ZeRO-0/1/2 (reduce_scatter on or off)    dp        (divides by dp x sp / sp)
    DeepSpeed ZeRO-3, reduce_scatter on (its default)  dp x sp
    DeepSpeed ZeRO-3, reduce_scatter off               dp        (divides by dp x sp / sp)
    a plain SUM all-reduce (``hf.sync_gradients``)     1

so ``scale_loss`` multiplies by that divisor (``grad_divisor``). Read from DeepSpeed
0.19.8's ``runtime/engine.py``, ``zero/stage_1_and_2.py``, ``zero/stage3.py`` and
``comm/coalesced_collectives.py``; the tests check each against one process.

DeepSpeed can also make the groups itself (``deepspeed.initialize(..., mesh_param=(dp, sp))``,
or ``data_parallel_size`` and ``sequence_parallel_size`` in its config): then take the
groups from its mesh, ``parallel_groups(mesh=engine.mesh_device)``, and ``hf.apply`` the
model (``engine.module``) with their ``sp_group``. Measured at dp 2 x sp 2 (DeepSpeed
0.19.8, gloo, float64, 3 SGD steps against one process): with DeepSpeed's own groups
ZeRO-3 reduces over all ``dp x sp`` ranks and divides as above (``dp x sp`` with
``reduce_scatter`` on, ``dp`` off), so it is right with the same scale; ZeRO-1/2 reduce
only over the ``dp`` group, so sequence partners end each step with different parameters,
which no loss scale repairs: ``grad_divisor`` refuses them (and ZeRO-0, not measured),
naming the setting (use ``mpu=groups.mpu()`` there). DeepSpeed's other groups, the ``parallel_state_sp`` module
as the mpu (after ``initialize_sequence_parallel(sp)``; what its
``UlyssesSPAttentionHF.register_with_transformers`` returns), reduce over every rank and
divide as ours: every stage is right with the same scale (measured as above).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..checks import UlyssesInputError

__all__ = ["MeshError", "ParallelGroups", "DeepSpeedMPU", "parallel_groups", "grad_divisor", "scale_loss", "global_loss"]

DIM_NAMES = ("dp", "sp")
DEEPSPEED_DIM_NAMES = ("data_parallel", "sequence_parallel")  # the mesh deepspeed.initialize makes from mesh_param


class MeshError(UlyssesInputError):
    """A mesh, group size or engine setting the dp x sp helpers cannot use."""


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """A 2-D ``("dp", "sp")`` DeviceMesh and the groups cut from it (the same on every rank).

    Attributes:
        mesh: the ``[dp, sp]`` DeviceMesh.
        dp_sp_mesh: the same ranks as one dimension (for FSDP2's ``fully_shard(mesh=...)``
            and for any reduction over every replica and sequence rank).
    """

    mesh: DeviceMesh
    dp_sp_mesh: DeviceMesh
    _mpu: list = field(default_factory=list, repr=False)  # the DeepSpeedMPU once built (its groups are collective to make)

    @property
    def dp_size(self) -> int:
        return self.mesh.size(0)

    @property
    def sp_size(self) -> int:
        return self.mesh.size(1)

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank(0)

    @property
    def sp_rank(self) -> int:
        return self.mesh.get_local_rank(1)

    @property
    def sp_group(self):
        """The sequence-parallel group: for ``hf.apply``, ``ulysses_attention``, ``DistributedAttention``."""
        return self.mesh.get_group(1)

    @property
    def dp_group(self):
        """The data-parallel group: this rank's peers holding the same sequence shard of other batches."""
        return self.mesh.get_group(0)

    @property
    def dp_sp_group(self):
        """Every rank of the mesh (ZeRO's partition and reduction group under sequence parallelism)."""
        return self.dp_sp_mesh.get_group(0)

    def mpu(self) -> DeepSpeedMPU:
        """The ``mpu`` for ``deepspeed.initialize(mpu=...)``. Collective the first time
        (it makes the size-1 model-parallel groups DeepSpeed asks for)."""
        if not self._mpu:
            self._mpu.append(DeepSpeedMPU(self))
        return self._mpu[0]


class DeepSpeedMPU:
    """The model-parallel unit DeepSpeed queries (``deepspeed.utils.groups``): sequence,
    sequence-data and data-parallel groups from a ``ParallelGroups``. With it DeepSpeed shards
    ZeRO state and reduces gradients over ``dp x sp`` ranks and counts the batch over ``dp``
    replicas.

    It follows the convention of DeepSpeed's own sequence-parallel mpu (the
    ``parallel_state_sp`` module that ``UlyssesSPAttentionHF.register_with_transformers``
    returns, 0.19.8 read): the model-parallel getters are the sequence-parallel ones
    (``get_model_parallel_rank() == get_sequence_parallel_rank()``), and it has
    ``initialize_sequence_parallel``, the attribute DeepSpeed looks for
    (``hasattr(mpu, "initialize_sequence_parallel")`` in ``utils/groups.py``,
    ``zero/stage_1_and_2.py``, ``zero/stage3.py``) to treat model parallelism as size 1 in
    ZeRO and in the engine. So the engine's ``mp_world_size`` is 1 and every rank names its
    checkpoint files ``mp_rank_00_*``: checkpoints move between sequence-parallel sizes and
    from runs without sequence parallelism (tests/test_alst.py, as DeepSpeed's
    ``TestUlyssesCheckpointLoad`` asserts it). Tensor parallelism, which DeepSpeed's
    backward-compatible helpers (``utils/bwc.py``) and activation checkpointing read first,
    is size 1. NOTE: for such an mpu DeepSpeed 0.19.8 leaves ``engine.dp_world_size`` at
    ``None`` (``groups._get_data_parallel_world_size``), so ``engine.set_train_batch_size()``
    raises a TypeError (measured; DeepSpeed's own module takes the same branch); the batch arithmetic of
    ``deepspeed.initialize`` reads ``get_data_parallel_world_size()`` below and is right.

    Do not also set ``sequence_parallel_size``/``data_parallel_size`` in the DeepSpeed
    config or pass ``mesh_param``: they make DeepSpeed build a mesh of its own as well
    (``grad_divisor`` refuses an engine with both).
    """

    def __init__(self, groups: ParallelGroups):
        self._groups = groups
        world = dist.get_world_size()
        # One singleton group per rank (made on every rank, as new_group requires): the
        # tensor-parallel group.
        self._tp_group, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """DeepSpeed's marker of a sequence-parallel mpu (it only checks that the attribute
        exists). The groups exist already: this checks the size and makes nothing."""
        if sequence_parallel_size != self._groups.sp_size:
            raise MeshError(
                f"DeepSpeedMPU.initialize_sequence_parallel: sequence_parallel_size expected {self._groups.sp_size} "
                f"(the groups were built with it), got {sequence_parallel_size}"
            )

    # sequence parallelism
    def get_sequence_parallel_group(self):
        return self._groups.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self._groups.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self._groups.sp_rank

    # ZeRO's partition and reduction group: every rank of dp x sp
    def get_sequence_data_parallel_group(self):
        return self._groups.dp_sp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._groups.dp_size * self._groups.sp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self._groups.dp_sp_group)

    # data parallelism
    def get_data_parallel_group(self):
        # NOTE: the dp x sp group, not the dp group: ZeRO-3 partitions the parameters over the
        # mpu's data-parallel group (zero/parameter_offload.py) and reduce-scatters their
        # gradients over it, so the sequence partners must be in it. With the dp group alone,
        # measured at dp 2 x sp 2, sequence partners ended a step with different gradients
        # (grad norms 2.18 and 1.83 against one process's 1.43).
        return self._groups.dp_sp_group

    # the batch size arithmetic (train_batch = micro x accumulation x dp) counts replicas

    def get_data_parallel_world_size(self) -> int:
        return self._groups.dp_size

    def get_data_parallel_rank(self) -> int:
        return self._groups.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.get_data_parallel_group())

    # model parallelism: DeepSpeed's sequence-parallel mpu aliases it to sequence parallelism
    # (parallel_state_sp.py); DeepSpeed sees the marker above and uses size 1 inside ZeRO and
    # for the checkpoint names. Its ZeRO-0 gradient clipping (runtime/utils.py
    # clip_grad_norm_) reads these three together: the norm of sequence rank 0, summed over
    # the sequence group, which is every rank's norm there (the gradients are all-reduced).
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank

    # tensor parallelism: none
    def get_tensor_model_parallel_group(self):
        return self._tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()


def _flatten(mesh: DeviceMesh) -> DeviceMesh:
    # NOTE: torch 2.14 spells it ``_flatten`` (torchtitan's way to get the dp x sp mesh for
    # FSDP2); a later public ``flatten`` is preferred when present.
    flatten = getattr(mesh, "flatten", None) or mesh._flatten
    return flatten("dp_sp")


def parallel_groups(sp_size: int | None = None, *, dp_size: int | None = None, mesh: DeviceMesh | None = None,
                    device_type: str | None = None) -> ParallelGroups:  # fmt: skip
    """Build (or take) the ``[dp, sp]`` DeviceMesh and the groups each engine wants.

    Args:
        sp_size: ranks per sequence group (must divide the world). Default: from ``mesh``.
        dp_size: data replicas; default ``world // sp_size``.
        mesh: a 2-D DeviceMesh to use instead, ``[dp, sp]`` (dimension names ``("dp", "sp")``,
            DeepSpeed's ``("data_parallel", "sequence_parallel")`` (``engine.mesh_device``),
            or unnamed, in that order).
        device_type: ``"cuda"`` or ``"cpu"``; default ``"cuda"`` when the process group's
            transport is NCCL, else ``"cpu"``.

    Collective: call it on every rank, in the same order as other group creation.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise MeshError("parallel_groups: torch.distributed is not initialized (init_process_group first)")
    world = dist.get_world_size()
    if mesh is None:
        if sp_size is None or not isinstance(sp_size, int) or sp_size < 1 or world % sp_size:
            raise MeshError(f"parallel_groups: sp_size expected a positive divisor of the world size ({world}), got {sp_size!r}")
        dp_size = world // sp_size if dp_size is None else dp_size
        if dp_size * sp_size != world:
            raise MeshError(f"parallel_groups: dp_size x sp_size expected {world} (the world size), got {dp_size} x {sp_size}")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (dp_size, sp_size), mesh_dim_names=DIM_NAMES)
    else:
        if mesh.ndim != 2:
            raise MeshError(f"parallel_groups: mesh expected 2 dimensions [dp, sp], got {mesh.ndim}")
        names = mesh.mesh_dim_names
        if names is not None and tuple(names) not in (DIM_NAMES, DEEPSPEED_DIM_NAMES):
            raise MeshError(f"parallel_groups: mesh dimension names expected {DIM_NAMES} or {DEEPSPEED_DIM_NAMES}, got {tuple(names)}")
        if sp_size is not None and mesh.size(1) != sp_size:
            raise MeshError(f"parallel_groups: sp_size ({sp_size}) differs from the mesh's sp dimension ({mesh.size(1)})")
        if names is None:
            mesh = DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=DIM_NAMES)
    return ParallelGroups(mesh, _flatten(mesh))


def _deepspeed_own_groups(config: dict, groups: ParallelGroups, own_mesh) -> None:
    """Check a DeepSpeed setup that makes its dp x sp groups itself (``own_mesh``: the engine's
    ``mesh_device``; or ``data_parallel_size``/``sequence_parallel_size`` in ``config``)."""
    keys = [k for k in ("data_parallel_size", "sequence_parallel_size") if k in config]
    if own_mesh is None and len(keys) == 1:
        raise MeshError(
            f"grad_divisor: the DeepSpeed config sets {keys[0]!r} without "
            f"{({'data_parallel_size', 'sequence_parallel_size'} - set(keys)).pop()!r}: DeepSpeed then makes no sequence "
            "group (its gradient scaling is not checked); set both, or neither and pass mpu=groups.mpu() to deepspeed.initialize"
        )
    shape = tuple(own_mesh.shape) if own_mesh is not None else (config["data_parallel_size"], config["sequence_parallel_size"])
    if shape != (groups.dp_size, groups.sp_size):
        raise MeshError(f"grad_divisor: DeepSpeed's dp x sp mesh is {shape[0]} x {shape[1]}, the groups' {groups.dp_size} x {groups.sp_size}")
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    if stage != 3:
        setting = "mesh_param" if own_mesh is not None and not keys else "'data_parallel_size'/'sequence_parallel_size'"
        raise MeshError(
            f"grad_divisor: DeepSpeed's own dp x sp groups ({setting}) with ZeRO stage {stage}: DeepSpeed reduces the "
            "gradients over the data-parallel group only, so sequence partners' parameters diverge (measured; no loss "
            "scale repairs it). Use ZeRO-3, or pass mpu=groups.mpu() to deepspeed.initialize instead"
        )


def _check_mpu(mpu, groups: ParallelGroups) -> None:
    """The engine's mpu (ours, or DeepSpeed's ``parallel_state_sp``) has the groups' sizes."""
    want = {"get_sequence_parallel_world_size": groups.sp_size, "get_sequence_data_parallel_world_size": groups.dp_size * groups.sp_size}
    for getter, size in want.items():
        if hasattr(mpu, getter) and getattr(mpu, getter)() != size:
            raise MeshError(f"grad_divisor: the DeepSpeed engine's mpu.{getter}() is {getattr(mpu, getter)()}, the groups' {size}")


def _deepspeed_divisor(config: dict, groups: ParallelGroups, own_mesh=None) -> int:
    """What DeepSpeed divides the dp x sp gradient sum by, from its config (a dict) and, for
    an engine, the mesh it made itself (``own_mesh``)."""
    if own_mesh is not None or "sequence_parallel_size" in config or "data_parallel_size" in config:
        _deepspeed_own_groups(config, groups, own_mesh)
    if config.get("prescale_gradients", False):
        raise MeshError("grad_divisor: DeepSpeed's 'prescale_gradients': true is not supported (its scaling is not checked); remove it")
    if config.get("gradient_predivide_factor", 1.0) != 1.0:
        raise MeshError(f"grad_divisor: DeepSpeed's 'gradient_predivide_factor' expected 1.0, got {config['gradient_predivide_factor']}")
    zero = config.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    if stage == 3 and zero.get("reduce_scatter", True):
        return groups.dp_size * groups.sp_size
    return groups.dp_size


def grad_divisor(engine, groups: ParallelGroups) -> int:
    """What ``engine`` divides the sum of the ``dp x sp`` ranks' gradients by.

    ``engine``: ``"fsdp2"`` (``fully_shard`` on ``groups.dp_sp_mesh`` with its default
    reduce-scatter mean), ``"sum"`` (a SUM all-reduce over ``groups.dp_sp_group``), a
    DeepSpeed config dict, or a ``DeepSpeedEngine`` (its config and, when DeepSpeed made
    the groups itself, its ``mesh_device`` are read). Raises ``MeshError`` naming a
    DeepSpeed setting whose gradient is not right or not checked (DeepSpeed's own groups
    with ZeRO-0/1/2 among them).
    """
    if engine == "fsdp2":
        return groups.dp_size * groups.sp_size
    if engine == "sum":
        return 1
    if isinstance(engine, dict):
        return _deepspeed_divisor(engine, groups)
    config = getattr(engine, "config", None)
    if isinstance(config, dict) and hasattr(engine, "zero_optimization_stage"):
        if engine.zero_optimization_stage() != int((config.get("zero_optimization") or {}).get("stage", 0)):
            raise MeshError("grad_divisor: the engine's ZeRO stage differs from its config's")
        own_mesh, mpu = getattr(engine, "mesh_device", None), getattr(engine, "mpu", None)
        if own_mesh is not None and mpu is not None:
            raise MeshError("grad_divisor: the DeepSpeed engine has both an mpu and its own mesh (mesh_param); pass one of them")
        if mpu is not None:
            _check_mpu(mpu, groups)
        return _deepspeed_divisor(config, groups, own_mesh)
    raise MeshError(f"grad_divisor: engine expected 'fsdp2', 'sum', a DeepSpeed config dict or engine, got {type(engine).__name__}")


def scale_loss(loss: torch.Tensor, num_tokens: int, groups: ParallelGroups, divisor: int) -> torch.Tensor:
    """This rank's loss for ``backward`` under dp x sp.

    Args:
        loss: this rank's share of its replica's mean, ``sum(token losses on this rank) /
            num_tokens`` (``out.loss`` of a model fed ``hf.shard_batch(...).model_inputs()``).
        num_tokens: the valid targets of this replica's batch (``ShardedBatch.num_tokens``,
            the same on the replica's sp ranks).
        divisor: ``grad_divisor(engine, groups)``.

    Returns ``sum(token losses on this rank) / N * divisor`` where ``N`` is the global count
    of valid targets over the dp replicas, so that the engine's reduced gradient is the
    gradient of the global token mean. Collective over ``groups.dp_group`` (one all-reduce
    of one integer).
    """
    count = torch.tensor([num_tokens], dtype=torch.int64, device=loss.device if loss.device.type != "meta" else "cpu")
    if groups.dp_size > 1:
        dist.all_reduce(count, group=groups.dp_group)
    total = int(count.item())
    return loss * (num_tokens * divisor / max(total, 1))


def global_loss(loss: torch.Tensor, num_tokens: int, groups: ParallelGroups) -> torch.Tensor:
    """The global token-mean loss (detached, for logging): every rank's share summed over dp x sp,
    weighted by its replica's count. Collective over ``groups.dp_sp_group``."""
    pair = torch.stack([loss.detach().double() * num_tokens, torch.tensor(float(num_tokens), dtype=torch.float64, device=loss.device)])
    dist.all_reduce(pair, group=groups.dp_sp_group)
    # Each replica's count was added once per sequence rank.
    return (pair[0] / (pair[1] / groups.sp_size).clamp_min(1)).to(loss.dtype)
