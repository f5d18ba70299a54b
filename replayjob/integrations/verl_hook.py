"""Deprecated: moved to :mod:`replayjob.producers.verl.hook` (see :mod:`replayjob.integrations`)."""

from replayjob.integrations import forward

globals().update({k: v for k, v in vars(forward(__name__, "replayjob.producers.verl.hook")).items()
                  if not k.startswith("__")})
