"""Deprecated: moved to :mod:`replayjob.producers.api.capture` (see :mod:`replayjob.integrations`)."""

from replayjob.integrations import forward

globals().update({k: v for k, v in vars(forward(__name__, "replayjob.producers.api.capture")).items()
                  if not k.startswith("__")})
