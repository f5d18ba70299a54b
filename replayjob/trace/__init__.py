"""Layer-level tracing of one replayed update and the comparison of two traces (``docs/trace-format.md``).

* :mod:`.recorder` -- forward/backward module hooks and parameter gradients at replay (tracing on only);
* :mod:`.fault` -- a test-only perturbation of one module's output (``REPLAYJOB_TRACE_FAULT``);
* :mod:`.store` -- the trace artifact: safetensors payload plus ``index.json`` written last, verified on read;
* :mod:`.envelope` -- the noise envelope: same-condition repeats, a reference pair, or a rounding bound;
* :mod:`.diff` -- ``replayjob trace-diff``: first divergent module forward and backward, per-layer errors.

Only :mod:`.recorder` and :mod:`.fault` touch a model; :mod:`.store`, :mod:`.envelope` and :mod:`.diff`
never import transformers or peft.
"""
