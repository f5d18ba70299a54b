"""The commands of the CLI, a module per group: each handler takes docopt's arguments and returns the exit
code (0 pass, 1 a negative verdict) or raises from the error root (2 refused, 3 error).

``replayjob.cli`` loads only the module of the command it runs (its table ``COMMANDS``), so a command that
needs little (``--help``, ``reduce``, ``diag-diff``) imports little; each module here imports what its
commands use at its top.
"""

ARGV, REEXEC = "<argv>", "<reexec>"  # what the CLI adds to docopt's arguments for `step`
