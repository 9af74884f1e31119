"""The `/v1/` routes' backend on the fleet's router: a create is placed on a replica as `/generate` is (the
translation done here, the job queued there with its files named by path); a video's record is the ledger's (asked
of the replica that holds it); its mp4 is read from the shared output folder; a delete goes to its owner.

Uploads are written under the router's state folder (the ledger's, by default the replicas' shared output folder),
which every replica reads at the same path."""

from __future__ import annotations

import time
from pathlib import Path

from ..auth import sees
from ..openai_videos import Submission, is_video
from ..uploads import UploadFolder
from ..validation import RequestError


class FleetVideos:
    """openai_routes.VideoBackend on the router."""

    def __init__(self, router):
        self.router = router
        self.keep_days = router.keep_days
        self.limits, self.http = router.limits, router.http
        self.started = time.time()
        state = router.state_folder
        self.uploads = UploadFolder(state, router.limits) if state is not None else None

    async def submit(self, submission: Submission, client) -> dict:
        files = {name: str(path) for name, path in submission.files.items()}
        status, answer, headers = await self.router.place("submit_video", submission.body, files, submission.labels,
                                                          client)
        if status != 202:
            raise RequestError(status, answer.get("error", "refused"), headers, param=answer.get("param"),
                               code=answer.get("code"))
        return answer

    async def record(self, job_id: str, client) -> dict | None:
        status, record = await self.router.job(job_id, client)
        if status != 200 or not is_video(record):
            return None
        return record

    async def records(self, client) -> list[dict]:
        ledger = self.router.ledger
        found = (ledger.answer(job["id"]) for job in ledger.jobs())
        return [r for r in found if is_video(r) and sees(client, r)]

    async def delete(self, job_id: str, client) -> None:
        status, answer, headers = await self.router.delete(job_id, client)
        if status != 200:
            raise RequestError(status, answer.get("error", "refused"), headers)

    async def modes(self) -> list[str]:
        for name in self.router.ledger.candidates():
            got = await self.router.call(name, "ready")
            if got["status"] == 200:
                return list(got["body"]["modes"])
        raise RequestError(503, f"no replica is ready ({self.router.ledger.not_ready_reason()})",
                           {"Retry-After": "5"})


def state_folder(settings: dict) -> Path | None:
    state = settings.get("state_file")
    return Path(state).parent if state else None
