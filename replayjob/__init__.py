"""replayjob: trustworthy systems experiments on RL post-training of LoRA adapters."""

__version__ = "0.1.0"
