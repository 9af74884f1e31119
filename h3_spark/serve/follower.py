"""A follower rank (`h3-spark serve --gpus N`, rank > 0): load, then run every job rank 0 sends.

lockstep.py is the protocol between the ranks; execute.py builds and runs a job. A follower needs both, and
lives apart from them so that the protocol does not import the job code that uses it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import traceback
from typing import Callable

import torch

from ..errors import H3Error
from .execute import free_memory, generate_job, prepare_job, read_continued
from .lockstep import Lockstep, LockstepCancel, load_in_lockstep


def follow(lockstep: Lockstep, load: Callable[[], object], log: Callable[[str], None]) -> int:
    """A follower rank (> 0): load, then run every job rank 0 sends until it sends None. Returns 0.

    SIGINT and SIGTERM are ignored: torchrun sends them to every rank at once, and a follower that died
    then would leave rank 0 in the middle of a collective instead of cancelling the job and sending None.
    (torchrun kills what is still running with SIGKILL 30 s after its own signal.)
    """
    from ..h3_model.pipeline.sampler import Cancelled

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    models = load_in_lockstep(load, lockstep)
    log(f"rank {lockstep.rank} of {lockstep.world} on {lockstep.device}: models resident; following rank 0")
    while True:
        # A failure here (rank 0 is gone) ends the loop: there is nobody left to follow.
        message = lockstep.receive()
        if message is None:
            log("rank 0 shut the service down")
            return 0
        job_id = message["id"]
        out_of_memory = False
        try:
            with contextlib.ExitStack() as stack:
                generation, _ = prepare_job(models, message, lockstep, stack)
                generate_job(models, generation, message["request"], cancel=LockstepCancel(),
                             continued=read_continued(message))  # rank 0 writes the output
            log(f"job {job_id} done")
        except Cancelled as exc:
            log(f"job {job_id} {exc}")
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            out_of_memory = True
            log(f"job {job_id}: out of memory: {exc}")
        except H3Error as exc:
            log(f"job {job_id} failed: {exc}")
        except Exception:  # noqa: BLE001 - one job's failure must not end the follower
            log(f"job {job_id} failed:\n{traceback.format_exc()}")
        if out_of_memory:
            free_memory()  # outside the except block, once the failed job's frames are gone


def rank_log(rank: int) -> Callable[[str], None]:
    def log(message: str) -> None:
        print(f"h3-spark serve (rank {rank}): {message}", file=sys.stderr, flush=True)

    return log
