"""Deprecated: moved to :mod:`replayjob.producers.trl.producer` (see :mod:`replayjob.integrations`)."""

from replayjob.integrations import forward

globals().update({k: v for k, v in vars(forward(__name__, "replayjob.producers.trl.producer")).items()
                  if not k.startswith("__")})
