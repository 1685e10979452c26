"""Mooncake's metadata keys: where a segment descriptor and an engine's rpc location are stored.

With a metadata server (anything but ``P2PHANDSHAKE``) Mooncake keeps two kinds of keys, both
holding one JSON object:

- ``segment_key(name)``  -> the segment descriptor (``flagcx_mc.metadata.descriptor.SegmentDesc``);
- ``rpc_meta_key(name)`` -> ``{"ip_or_host_name": str, "rpc_port": int}``, where the engine's
  handshake listener is.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError

__all__ = ["key_prefix", "segment_key", "rpc_meta_key"]

#
# Implemented exactly as Mooncake's TransferMetadata (transfer_metadata.cpp):
#   prefix      = "mooncake/" + C, where C = $MC_METADATA_CLUSTER_ID with a "/" appended
#                 unless it already ends in one; C = "" when the variable is unset or empty
#   segment key = prefix + "ram/" + name     (getFullMetadataKey, name without "/")
#               = prefix + name              (name already containing "/" is a path)
#   rpc key     = prefix + "rpc_meta/" + name
# e.g. MC_METADATA_CLUSTER_ID=prod: "mooncake/prod/ram/10.0.0.5:15873" and
# "mooncake/prod/rpc_meta/10.0.0.5:15873". The engine's EngineConfig reads the variable.


def key_prefix(cluster_id: str = "") -> str:
    """The common key prefix: ``"mooncake/"`` or ``"mooncake/<cluster_id>/"``."""
    if cluster_id and not cluster_id.endswith("/"):
        cluster_id += "/"
    return "mooncake/" + cluster_id


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what} must be a non-empty str, not {name!r}")


def segment_key(name: str, cluster_id: str = "") -> str:
    """Key of a segment descriptor (Mooncake's ``getFullMetadataKey``).

    Raises:
        InvalidArgumentError: ``name`` is empty.
    """
    _check_name(name, "segment name")
    if "/" in name:
        return key_prefix(cluster_id) + name
    return key_prefix(cluster_id) + "ram/" + name


def rpc_meta_key(name: str, cluster_id: str = "") -> str:
    """Key of an engine's RPC location ``{"ip_or_host_name", "rpc_port"}``.

    Raises:
        InvalidArgumentError: ``name`` is empty.
    """
    _check_name(name, "server name")
    return key_prefix(cluster_id) + "rpc_meta/" + name
