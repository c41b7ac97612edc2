"""The `qos-level` gRPC metadata: parsing, defaults and propagation."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from services.common.errors import InvalidArgument

QOS_METADATA_KEY = "qos-level"


class QosLevel(enum.IntEnum):
    """Lower value = served first. The names are the metadata values."""

    REALTIME = 0
    STANDARD = 1
    BEST_EFFORT = 2

    @property
    def wire(self) -> str:
        return self.name.lower().replace("_", "-")


_BY_WIRE = {level.wire: level for level in QosLevel}


# Aging: a waiting request moves up one class for every AGING_S seconds it has waited, so a
# backlogged best-effort request competes as realtime after 2 * AGING_S seconds and is then
# served in arrival order among realtime work: no class starves, whatever the load above it.
AGING_S = 2.0


def effective_class(level: QosLevel, waited_s: float, aging_s: float = AGING_S) -> int:
    """The class a request competes in after waiting `waited_s` (0 = realtime)."""
    return max(0, int(level) - int(waited_s // aging_s))


def parse_qos(value: str | None) -> QosLevel:
    """Map a metadata value to a level; absent means `standard`, unknown is INVALID_ARGUMENT."""
    if value is None or value == "":
        return QosLevel.STANDARD
    level = _BY_WIRE.get(value.strip().lower())
    if level is None:
        raise InvalidArgument(f"unknown qos-level {value!r}: use one of {', '.join(_BY_WIRE)}")
    return level


def metadata_value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The first value of `key` in invocation metadata, or None."""
    for k, value in metadata or ():
        if k == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def qos_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> QosLevel:
    """Read `qos-level` from invocation metadata (the first value wins)."""
    value = metadata_value(metadata, QOS_METADATA_KEY)
    return QosLevel.STANDARD if value is None else parse_qos(value)


def qos_metadata(level: QosLevel) -> tuple[tuple[str, str], ...]:
    """Metadata to send downstream so the next service queues the work alike."""
    return ((QOS_METADATA_KEY, level.wire),)
