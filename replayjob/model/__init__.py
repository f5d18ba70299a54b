"""Model construction: the backend registry, the built-in transformers + peft backend, tokenizers.

Importing this package does not import transformers or peft; only building a policy does.
"""

from replayjob.model.backend import Backend, Policy, load_backend

__all__ = ["Backend", "Policy", "load_backend"]
