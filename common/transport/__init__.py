"""The one transport boundary (see base.py): ZeroMQ links, an in-process pair, a fault wrapper."""

from elasticfed.common.transport.base import (
    DONE,
    Event,
    Frames,
    Link,
    LinkEvent,
    Received,
    Refusal,
    SendRefused,
    Tracker,
)
from elasticfed.common.transport.faulty import FaultyLink
from elasticfed.common.transport.memory import MemoryHub
from elasticfed.common.transport.zeromq import DealerLink, RouterLink

__all__ = [
    "DONE",
    "DealerLink",
    "Event",
    "FaultyLink",
    "Frames",
    "Link",
    "LinkEvent",
    "MemoryHub",
    "Received",
    "Refusal",
    "RouterLink",
    "SendRefused",
    "Tracker",
]
