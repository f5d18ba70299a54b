"""Deprecated: moved to :mod:`replayjob.producers.verl.producer` (see :mod:`replayjob.integrations`)."""

from replayjob.integrations import forward

globals().update({k: v for k, v in vars(forward(__name__, "replayjob.producers.verl.producer")).items()
                  if not k.startswith("__")})
