"""The command line and what it runs besides training: ``info``, ``ingest``, ``predict``, ``plot``."""
