"""The service's resident models: one `Engine`, loaded once, with its loading state for `/ready`.

`load_models` builds the service's engine from the flags (`ComponentPaths` + `LoadOptions`) and feeds
the engine's per-component progress into a `LoadTracker`, which `/ready` reads while loading is still
going on. Everything else (paths, loaders, kernel checks and configuration) is the engine's.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from ..h3_model.engine.engine import Engine, LoadEvent
from ..h3_model.engine.loading import LoadOptions
from ..h3_model.engine.paths import ComponentPaths


class LoadTracker:
    """Thread-safe loading state: overall (loading | ready | failed) and per component."""

    def __init__(self, names: list[str] | tuple[str, ...] = ()):
        self._lock = threading.Lock()
        self.state = "loading"
        self.error: str | None = None
        self.components: dict[str, dict] = {n: {"state": "pending"} for n in names}

    def plan(self, names: list[str]) -> None:
        with self._lock:
            self.components = {n: {"state": "pending"} for n in names}

    def fail(self, error: str, name: str | None = None) -> None:
        with self._lock:
            if name is not None:
                self.components[name] = {"state": "failed", "error": error}
            self.state, self.error = "failed", error

    def ready(self) -> None:
        with self._lock:
            self.state = "ready"

    def snapshot(self) -> dict:
        with self._lock:
            out = {"state": self.state, "components": {k: dict(v) for k, v in self.components.items()}}
            if self.error:
                out["error"] = self.error
            out["still_loading"] = [k for k, v in self.components.items() if v["state"] in ("pending", "loading")]
            return out

    def record(self, event: LoadEvent) -> None:
        """The engine's progress callback."""
        with self._lock:
            if event.state == "loading":
                self.components[event.component] = {"state": "loading"}
            elif event.state == "resident":
                self.components[event.component] = {"state": "resident", "seconds": event.seconds}
        if event.state == "failed":
            self.fail(event.error or "failed", event.component)


def load_models(paths: ComponentPaths, options: LoadOptions, tracker: LoadTracker,
                overrides: Mapping[str, Callable[[], object]] | None = None, taeh3: Path | None = None,
                controlnet: Path | None = None) -> Engine:
    """The engine with the text encoder, the DiT partition(s) found, the video VAE and the audio VAE loaded, and
    TAEH3 from `taeh3` (serve --taeh3) when given.

    `overrides` maps a component name to a function that builds that component instead of reading it
    from a path (an embedding host that already holds the model, or a test's in-memory encoder).
    Raises H3Error naming what is missing or cannot run; the tracker records it too.
    """
    engine = Engine(paths, options, overrides=overrides)
    tracker.plan(list(engine.plan()) + (["taeh3"] if taeh3 is not None else [])
                 + (["controlnet"] if controlnet is not None else []))
    if controlnet is not None:  # against the DiTs' headers, before any weight loads
        engine.check_controlnet(controlnet)
    engine.load(on_progress=tracker.record)
    if controlnet is not None:
        _load_extra(tracker, "controlnet", lambda: engine.load_controlnet(controlnet))
    if taeh3 is not None:
        _load_extra(tracker, "taeh3", lambda: engine.load_taeh3(taeh3))
    return engine


def _load_extra(tracker, name: str, load) -> None:
    """A model loaded beside the engine's components (the ControlNet, TAEH3), reported to `tracker` as they are."""
    tracker.record(LoadEvent(name, "loading"))
    started = time.perf_counter()
    try:
        load()
    except Exception as exc:
        tracker.record(LoadEvent(name, "failed", error=str(exc)))
        raise
    tracker.record(LoadEvent(name, "resident", seconds=time.perf_counter() - started))
