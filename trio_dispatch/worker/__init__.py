"""The long-running worker (SPEC section 5): :class:`DispatchWorker` in
:mod:`.loop`, its delivery slots in :mod:`.slots`, its frozen
:class:`WorkerStatistics` in :mod:`.statistics`."""

from __future__ import annotations

from .loop import FINISH_RETRY_DELAYS, DispatchWorker, Interrupted
from .slots import SlotTable
from .statistics import WorkerStatistics

__all__ = ["FINISH_RETRY_DELAYS", "DispatchWorker", "Interrupted", "SlotTable", "WorkerStatistics"]
