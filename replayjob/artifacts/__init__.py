"""Declared documents: one module per document replayjob reads, its declaration beside its reader.

:mod:`.document` says how a document is declared (:class:`~.document.Document`, the typed aliases) and
read (:func:`~.document.decode`); each other module declares one document.
"""
