"""Deprecated: moved to :mod:`replayjob.producers.torch_loop` (see :mod:`replayjob.integrations`)."""

from replayjob.integrations import forward

globals().update({k: v for k, v in vars(forward(__name__, "replayjob.producers.torch_loop")).items()
                  if not k.startswith("__")})
