"""forklm on Ray Serve: engine replicas behind an HTTP ingress, each request routed by the
router's policy (cache-aware by default) through Ray Serve's request-router extension.

Ray is optional: nothing here imports it until an application is built (`pip install
'forklm[ray]'`). `serve run forklm.ray_serve:build_app dp-size=2` or `forklm serve --ray`."""

from __future__ import annotations

from typing import Any

RAY_MISSING = ("Ray Serve is not installed; `forklm serve --ray` needs it: "
               "pip install 'forklm[ray]'")


def require_ray() -> None:
    """Raise ImportError naming the extra to install when ray[serve] is missing."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve's application builder (`serve run forklm.ray_serve:build_app KEY=VALUE ...`):
    the keys are `forklm serve` flags without the dashes (dp-size=2, max-total-tokens=4096)."""
    require_ray()
    from forklm.ray_serve.app import application_from_flags

    return application_from_flags(args)
