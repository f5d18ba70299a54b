"""Deprecated: moved to :mod:`replayjob.producers.verl.plugin` (see :mod:`replayjob.integrations`)."""

from replayjob.integrations import forward

globals().update({k: v for k, v in vars(forward(__name__, "replayjob.producers.verl.plugin")).items()
                  if not k.startswith("__")})
