"""The optional dependencies (pyproject.toml's extras) and what to tell a user who lacks one.

The core dependencies (cffi, h11, orjson, pyzmq, uvloop) are always installed; the packages below
are imported only by the feature that needs them, which then says which extra installs them
instead of letting an ImportError escape from deep inside.
"""

from __future__ import annotations

__all__ = ["EXTRAS", "install_hint"]

# extra -> the importable packages it provides (its requirements in pyproject.toml).
EXTRAS: dict[str, tuple[str, ...]] = {
    "redis": ("redis",),
    "prometheus": ("prometheus_client",),
    "bench": ("matplotlib", "mooncake"),
}


def install_hint(extra: str, package: str) -> str:
    """``"needs the 'redis' package: pip install 'flagcx_mc[redis]'"``: the missing package and the
    extra that provides it (quoted for shells that expand brackets)."""
    if package not in EXTRAS.get(extra, ()):
        raise ValueError(f"no extra {extra!r} provides {package!r}")
    return f"needs the {package!r} package: pip install 'flagcx_mc[{extra}]'"
