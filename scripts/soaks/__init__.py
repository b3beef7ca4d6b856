"""What the reliability drivers (``scripts/soak.py``, ``ordering_soak.py``,
``schedule_soak.py``) share: :mod:`.common`, their child processes and
reads of the store; :mod:`.roles`, the crash soak's roles."""
