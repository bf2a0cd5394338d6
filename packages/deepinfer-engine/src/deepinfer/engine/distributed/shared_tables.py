"""Host Engram tables in memory the ranks of a node share: one copy per node, not one per rank.

V4.1-Flash's two tables are about 98 GB each; eight ranks on a node each loading their own
copy would need eight times that. Instead the node's first rank (its leader) creates one
anonymous shared-memory file per table tensor (``memfd_create``) and fills it once, from the
checkpoint or with dummy values; the node's other ranks open the same file through
``/proc/<leader pid>/fd/<n>``. Every rank then maps it read-only (so no rank can change the
others' table) and, on CUDA, registers its mapping as pinned memory. An anonymous file has no
name to clean up: the kernel frees it with its last mapping, so a rank that fails or is killed
leaves nothing behind in ``/dev/shm``.

The steps are collective over every rank, on a gloo group with the loading timeout: the ranks
find their node's leader (same host name and boot id; the lowest rank there leads), the model
is built with its host tables on the meta device (:func:`host_tables_deferred`) so no rank
allocates them, the ordinary load skips them, the leaders fill theirs and publish the
descriptors, every rank maps them, and a barrier marks all mapped before the leaders close
their descriptors.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import socket
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.engine.model.engram import EngramTable, host_tables_deferred

logger = logging.getLogger("deepinfer.engine")

__all__ = ["NodeTableShare", "host_tables_deferred", "node_table_share", "shared_table_mappings"]

# Filling a ~98 GB table takes far longer than a step: the collectives wait this many timeouts.
LOAD_TIMEOUT_FACTOR = 30
CUDA_HOST_REGISTER_FLAGS = 1 | 8  # cudaHostRegisterPortable | ReadOnly: the device only reads it
FILE_PREFIX = "deepinfer-engram:"


@dataclass(frozen=True)
class TableTensor:
    """One deferred tensor of a host table: the module attribute it becomes."""

    name: str  # state_dict name, the checkpoint's
    module: EngramTable
    attr: str  # "weight" or "scale"
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


def node_table_share(timeout_s: float, has_engram: bool) -> NodeTableShare | None:
    """This rank's place in its node's table sharing, or None: no process group of several
    ranks, or a model without Engram tables. Collective: every rank calls it."""
    if not has_engram or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return NodeTableShare.join(timeout_s * LOAD_TIMEOUT_FACTOR)


@dataclass(frozen=True)
class NodeTableShare:
    """Who fills this node's tables (``leader``, a global rank, with its ``leader_pid``)."""

    group: Any  # gloo group over every rank
    rank: int
    world_size: int
    leader: int
    leader_pid: int
    num_local_ranks: int

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @classmethod
    def join(cls, timeout_s: float) -> NodeTableShare:
        """Find the ranks on this node: collective over the default group's ranks, whose
        collectives here run on a new gloo group that waits up to ``timeout_s``."""
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, (_node_key(), os.getpid()), group=group)
        local = [r for r, (key, _) in enumerate(everyone) if key == everyone[rank][0]]
        return cls(group, rank, world_size, local[0], everyone[local[0]][1], len(local))

    def place(self, model: nn.Module, fill: Callable[[dict[str, torch.Tensor]], None]) -> int:
        """Give every deferred host table of ``model`` its node-shared storage; the leader
        fills it first with ``fill(tensors by name)``. Returns the bytes this node holds once."""
        tensors = deferred_table_tensors(model)
        if not tensors:  # every rank built the same model: none has host tables to share
            return 0
        fds: dict[str, int] = {}
        try:
            if self.is_leader:
                fds = {t.name: _create(t) for t in tensors}
                writable = {t.name: _map(fds[t.name], t, writable=True)[0] for t in tensors}
                fill(writable)
                del writable  # unmapped: the ranks map the filled files read-only
            published: list[Any] = [None] * self.world_size
            mine = fds if self.is_leader else None
            dist.all_gather_object(published, mine, group=self.group)
            self._map_all(tensors, published[self.leader])
            dist.barrier(group=self.group)  # every rank mapped: the descriptors may close
        finally:
            for fd in fds.values():
                os.close(fd)
        total = sum(t.nbytes for t in tensors)
        logger.info(
            "Engram tables: %.2f GB in node shared memory, one copy for %d local ranks",
            total / 1e9,
            self.num_local_ranks,
        )
        return total

    def _map_all(self, tensors: list[TableTensor], leader_fds: dict[str, int]) -> None:
        unpinned = []  # "name (error N)" of the mappings the CUDA runtime would not register
        for t in tensors:
            if t.name not in leader_fds:
                raise RuntimeError(
                    f"Engram table {t.name!r}: rank {self.leader} (this node's leader) did not "
                    f"create it (its tables: {sorted(leader_fds)}); the ranks built different models"
                )
            fd = leader_fds[t.name] if self.is_leader else self._open_leader_fd(t, leader_fds)
            try:
                tensor, buffer = _map(fd, t, writable=False)
            finally:
                if not self.is_leader:
                    os.close(fd)
            if t.module.host and torch.cuda.is_available():
                error = _pin(tensor, buffer)
                if error:
                    unpinned.append(f"{t.name} (error {error})")
            setattr(t.module, t.attr, nn.Parameter(tensor, requires_grad=False))
        if unpinned:
            warnings.warn(
                f"Engram tables: cudaHostRegister refused the shared read-only mappings of "
                f"{', '.join(unpinned)}; they stay in pageable shared memory (the rows a step "
                "reads are still staged through pinned buffers)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _open_leader_fd(self, t: TableTensor, leader_fds: dict[str, int]) -> int:
        path = f"/proc/{self.leader_pid}/fd/{leader_fds[t.name]}"
        try:
            return os.open(path, os.O_RDONLY)
        except OSError as error:
            raise RuntimeError(
                f"Engram table {t.name!r}: rank {self.rank} cannot open the shared file of rank "
                f"{self.leader} (pid {self.leader_pid}) at {path}: {error}; the ranks of a node "
                "must run as one user in one PID namespace"
            ) from error


def deferred_table_tensors(model: nn.Module) -> list[TableTensor]:
    """The host Engram table tensors ``model`` was built without (on the meta device)."""
    found = []
    for prefix, module in model.named_modules():
        if not isinstance(module, EngramTable):
            continue
        for attr in ("weight", "scale"):
            t = getattr(module, attr)
            if t is not None and t.is_meta:
                name = f"{prefix}.{attr}" if prefix else attr
                found.append(TableTensor(name, module, attr, tuple(t.shape), t.dtype))
    return found


@dataclass(frozen=True)
class TableMapping:
    """A shared table file as a process maps it (``/proc/<pid>/maps``)."""

    name: str
    inode: int
    num_bytes: int  # of the mapping: the file's size rounded up to whole pages
    perms: str


def shared_table_mappings(pid: int | str = "self") -> list[TableMapping]:
    """The shared table files process ``pid`` maps: ranks that list the same inode share one
    copy. For checks and tests; the kernel names the files ``/memfd:deepinfer-engram:<name>``."""
    found = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or FILE_PREFIX not in fields[5]:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            name = fields[5].split(FILE_PREFIX, 1)[1].removesuffix("\n").removesuffix(" (deleted)")
            found.append(TableMapping(name, int(fields[4]), end - start, fields[1]))
    return found


def _node_key() -> str:
    """Ranks with the same key share /dev/shm and the kernel's memory: one host, one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _create(t: TableTensor) -> int:
    fd = os.memfd_create(FILE_PREFIX + t.name, os.MFD_CLOEXEC)
    os.ftruncate(fd, t.nbytes)
    return fd


def _map(fd: int, t: TableTensor, writable: bool) -> tuple[torch.Tensor, mmap.mmap]:
    """``t``'s tensor over a shared mapping of ``fd`` (read-only unless ``writable``)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    buffer = mmap.mmap(fd, t.nbytes, flags=mmap.MAP_SHARED, prot=prot)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps ``buffer`` alive
    return flat.view(t.dtype).view(t.shape), buffer


def _pin(tensor: torch.Tensor, buffer: mmap.mmap) -> int:
    """Register the read-only mapping as pinned memory, unregistered when it is unmapped;
    returns the CUDA error (0: pinned)."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    error = int(cudart.cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_FLAGS))
    if error:
        _clear_last_cuda_error()
    else:
        weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)
    return error


def _clear_last_cuda_error() -> None:
    """A failed call leaves the CUDA runtime's last error set, and torch would raise it at its
    next kernel launch: read it off (through the runtime torch loaded; best effort)."""
    major = (torch.version.cuda or "").split(".")[0]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
