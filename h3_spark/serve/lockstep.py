"""One job over several GPUs (`h3-spark serve --gpus N`): rank 0 serves, the other ranks follow in lockstep.

Every rank (one process per GPU, started by torchrun) loads the same models and splits each DiT's
forwards over the ranks (dit/parallel.py), so one generation needs every rank inside the same
collectives in the same order. Rank 0 runs the HTTP service as with one GPU; for each job its JobRunner broadcasts a message
(the validated request, the input paths, the tile and chunk settings), and each follower builds the
same GenerationRequest from it (execute.build_generation), switches to the same attention backend
and runs the same `pipeline.generate` (follower.py: the followers' loop); only rank 0 writes the output.
A None message ends the followers; rank 0 sends it when the service stops.

Two process groups:
  * the default one (NCCL on GPUs, gloo on CPUs) carries the DiT's all-to-alls, the shared video
    decode and the cancel flag, with torch's usual timeout;
  * a gloo "control" group, with no practical timeout, carries the job messages and the agreements.
    A follower waits there for the next job for as long as the service is idle; on the default
    group that wait would hit the timeout (and NCCL's watchdog would abort the process).

Before any generation the ranks agree (`agree`): each reports whether it could build the request and a
fingerprint of the inputs it read; if any rank failed, or read different bytes (a file changed between
reads), every rank drops the job, so no rank enters a collective the others will not.

Cancellation is collective (`LockstepCancel`): each check is an all-reduce (MAX) of rank 0's flag, so
every rank stops at the same block. Known limit: an error that hits one rank alone in the middle of a
generation (out of memory on one GPU) leaves the others waiting in a collective until the default
group's timeout (NCCL: 10 minutes unless torch is told otherwise); the service is not usable meanwhile.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import H3Error
from ..h3_model.pipeline.generation import GenerationRequest

# The control group's timeout: a follower may wait this long for the next job.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class Lockstep:
    """This rank's place in the world, and the control group every rank joined."""

    rank: int
    world: int
    device: str
    control: object  # a gloo ProcessGroup

    @classmethod
    def join(cls, rank: int, world: int, device: str) -> "Lockstep":
        # new_group is collective: every rank calls it here, right after init_process_group.
        return cls(rank, world, device, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))

    def gather(self, value) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.control)
        return out

    def agree(self, error: BaseException | None, value=None, what: str = "prepare the job", *,
              same: bool = True) -> list:
        """Every rank's `value`, once every rank got this far without an error; else raise on every rank.

        A rank re-raises its own error (so rank 0 classifies it as without lockstep); the others raise an
        H3Error naming the rank(s) that failed. `same`: the values must also be equal (input fingerprints).
        """
        message = None if error is None else (str(error) if isinstance(error, H3Error)
                                              else f"{type(error).__name__}: {error}")
        reports = self.gather((message, value))
        if error is not None:
            raise error
        failed = [(rank, m) for rank, (m, _) in enumerate(reports) if m is not None]
        if failed:
            raise H3Error("; ".join(f"rank {rank} could not {what}: {m}" for rank, m in failed))
        values = [v for _, v in reports]
        if same and len(set(values)) > 1:
            raise H3Error(f"the ranks read different inputs and could not {what} (did a file change while it "
                          f"was read?)")
        return values

    def send(self, message) -> None:
        """Rank 0: hand a job (or None: shut down) to every follower."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


class LockstepCancel:
    """`cancel=` for pipeline.generate on every rank: set on all ranks when it is set on rank 0.

    Each is_set() is a collective, so every rank must call it equally often; they do, since they run
    the same request through the same code (the sampler checks before each step and between blocks).
    """

    def __init__(self, flag: threading.Event | None = None):
        self.flag = flag  # rank 0: the job's cancel event; followers: None
        # NCCL reduces CUDA tensors only; gloo CPU ones.
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                       else torch.device("cpu"))

    def is_set(self) -> bool:
        flag = torch.tensor([1 if self.flag is not None and self.flag.is_set() else 0], dtype=torch.int32,
                            device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def fingerprint(generation: GenerationRequest) -> str:
    """A hash of the media a request read (shapes and bytes): equal requests on every rank, or no job."""
    h = hashlib.blake2b(digest_size=16)

    def add(tensor) -> None:
        if tensor is not None:
            h.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            h.update(tensor.detach().contiguous().cpu().numpy().tobytes())

    for ref in generation.references:
        h.update(ref.kind.encode())
        for name in ("image", "frames", "audio"):
            add(getattr(ref, name, None))
    add(generation.first_frame)
    add(generation.last_frame)
    return h.hexdigest()


class Leader:
    """Rank 0's side: one job at a time under a lock, so the control group's messages stay in order."""

    def __init__(self, lockstep: Lockstep, log: Callable[[str], None]):
        self.lockstep = lockstep
        self.log = log
        self.lock = threading.Lock()
        self.ready = False  # set once the ranks agreed that every one loaded its models
        self.closed = False

    def close(self) -> None:
        """Tell the followers to exit, unless a job or the loading still holds the control group."""
        if not self.lock.acquire(blocking=False):
            self.log("a job still runs; the other ranks are left to torchrun")
            return
        try:
            if self.ready and not self.closed:
                self.lockstep.send(None)
                self.log(f"told the other {self.lockstep.world - 1} rank(s) to shut down")
            elif not self.ready:
                self.log("the other ranks are still loading; they end when this process does")
            self.closed = True
        finally:
            self.lock.release()


def load_in_lockstep(load: Callable[[], object], lockstep: Lockstep, leader: Leader | None = None):
    """Load the models on this rank, split each DiT's forwards over the ranks, and agree with the other ranks.

    Every rank reaches the agreement, also after a failed load: a rank that raised before it would
    leave the others waiting for it. Returns the engine, with every rank's device.
    """
    models, error = None, None
    try:
        models = load()
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the agreement below
        error = exc
    # Under the leader's lock: rank 0's service must not send on the control group meanwhile.
    with leader.lock if leader is not None else threading.Lock():
        devices = lockstep.agree(error, lockstep.device, "load the models", same=False)
        models.distribute(devices, dist.group.WORLD)
        if leader is not None:
            leader.ready = True
    return models
