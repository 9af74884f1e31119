"""A fleet of hot services on Ray Serve: N replicas, each one `Service` on its own GPU (or CPU), behind one router.

config.py reads and checks the fleet's settings, replica.py is one replica, ledger.py is the router's record of
which replica owns which job, router.py is the HTTP front, app.py binds them into a Ray Serve application
(`build_fleet`, and `app_builder` for `serve run`). Importing this package needs nothing beyond h3-spark; the
modules that talk to Ray call `require_ray` first so that a missing Ray is one line, not a traceback.
"""

from __future__ import annotations

from ...errors import H3Error

INSTALL_HINT = "the fleet needs Ray Serve: pip install 'h3-spark[fleet]'"


def require_ray():
    """The `ray.serve` module, or H3Error in one line when Ray (or its serve part) is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError as exc:
        raise H3Error(f"{INSTALL_HINT} ({exc})") from None
    return serve
