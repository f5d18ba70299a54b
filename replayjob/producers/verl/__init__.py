"""verl as a producer: an actor update captured from a verl run and replayed without Ray or rollout (docs/verl.md).

* :mod:`.producer` -- :func:`~.producer.capture_actor_steps`, the capture of chosen steps, and the replay session;
* :mod:`.fields` -- every field of verl's actor, engine, optimizer and loss configs classified;
* :mod:`.platform` -- the CPU platform verl's FSDP2 engine runs on here (gloo);
* :mod:`.plugin` -- the config switch a Ray run imports in its workers (``actor_rollout_ref.model.external_lib``).

Importing this package imports no framework.
"""
