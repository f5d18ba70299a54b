"""Checks over per-step diagnostics: leafwise diag diffs, the twice-run determinism check and
behavioural signal verdicts.  Nothing here imports a model library, so these commands start fast
on any node and work for any trainer that writes JSONL diagnostics."""
