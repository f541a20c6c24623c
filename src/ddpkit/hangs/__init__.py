"""Hang detection: a watchdog thread per rank on torch's flight recorder (``_watchdog``), the report it writes
(``_report``: pure functions) and the Python stacks in it (``_stacks``). Internal: users see ``HangError`` and
the ``timeout`` of ``launch``/``ddpkit run``."""
