"""Seeing a run from outside: the timeline writer (``--trace``) and the stall monitor
(``--stall-timeout``)."""
