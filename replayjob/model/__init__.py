"""Model construction: the backend registry (:mod:`replayjob.model.backend`), the built-in transformers + peft
backend (:mod:`replayjob.model.hf`), tokenizers, and the mixture-of-experts routing records
(:mod:`replayjob.model.moe`).

Importing this package imports none of its modules: the gate reads routing records through
:mod:`replayjob.model.moe` without the backend registry (whose entry-point lookup costs a ``reduce``
tens of milliseconds of start-up), and only building a policy imports transformers or peft.
"""
