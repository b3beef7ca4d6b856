"""Delivering (docs/usage.md): the long-running :class:`DispatchWorker`
in :mod:`.loop`, the single pass :func:`deliver_due_dispatches` and the
transport call both use in :mod:`.attempts`, how an attempt's end is
recorded in :mod:`.outcomes`, what is logged and measured of it in
:mod:`.report`, the delivery slots in :mod:`.slots`, and the frozen
:class:`WorkerStatistics` in :mod:`.statistics`."""

from __future__ import annotations

from .attempts import deliver_due_dispatches
from .loop import DispatchWorker
from .outcomes import FINISH_RETRY_DELAYS
from .report import Interrupted
from .slots import SlotTable
from .statistics import WorkerStatistics

__all__ = [
    "FINISH_RETRY_DELAYS",
    "DispatchWorker",
    "Interrupted",
    "SlotTable",
    "WorkerStatistics",
    "deliver_due_dispatches",
]
