"""The built-in backend: a transformers causal LM with a peft LoRA adapter.

The base model is either a local directory (safetensors weights only, never pickle) or the
built-in tiny Llama-style config, randomly initialised from ``model.init_seed``.  The adapter is
initialised from ``training.seed`` or loaded from ``resume.from``.  Construction never consumes
the global Torch RNG: sampling and dropout see the same stream whatever the model size.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob import tensorfile
from replayjob.config import Config
from replayjob.config.load import to_dict
from replayjob.digest import sha256_file
from replayjob.errors import ConfigError, ContractError
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import pretty_bytes
from replayjob.model import moe
from replayjob.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from replayjob.redact import redact_text
from replayjob.rl.state import ADAPTER_WEIGHTS, adapter_bytes
from replayjob.runtime.distributed import full

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
_BUILTIN_KEYS = ("init_seed", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "max_position_embeddings")
_MOE_KEYS = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def builtin_model_reference(cfg: Config) -> dict[str, Any]:
    m = to_dict(cfg.model)
    if cfg.model.path:
        cfg_file = Path(cfg.model.path) / "config.json"
        return {"kind": "local", "path": redact_text(cfg.model.path),  # recorded in resume states
                "config_sha256": sha256_file(cfg_file, follow_symlinks=True) if cfg_file.is_file() else None}
    if cfg.model.architecture != "llama":  # the dense model's reference is the one earlier states recorded
        return {"kind": "builtin-tiny", **{k: m[k] for k in _BUILTIN_KEYS + _MOE_KEYS}}
    return {"kind": "builtin-tiny", **{k: m[k] for k in _BUILTIN_KEYS}}


class HFPolicy:
    def __init__(self, model: Any, tokenizer: Tokenizer, device: torch.device, cfg: Config):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.cfg = cfg
        self.gradient_checkpointing = cfg.backend.options.gradient_checkpointing
        self._trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._adapter_params: dict[str, torch.nn.Parameter] | None = None
        #: the MoE routers' observer (and, under model.routing = "forced", their forcing); None: no router
        self.routing: moe.Routing | None = moe.attach(model, cfg)

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self._trainable)

    def reference(self) -> contextlib.AbstractContextManager[None]:
        ctx: contextlib.AbstractContextManager[None] = self.model.disable_adapter()
        return ctx

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter tensors under peft's weight-file names, sorted; views of the live parameters on the
        CPU.  peft's walk over the model (milliseconds) runs once: its tensors are the trainable
        parameters themselves, so later calls read them through a name -> parameter map."""
        if self._adapter_params is None:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.model)
            by_storage = {p.data_ptr(): p for _, p in self._trainable}
            found = {k: by_storage.get(v.data_ptr()) for k, v in state.items()}
            if any(p is None or p.shape != state[k].shape for k, p in found.items()):
                return {k: v.detach().to("cpu").contiguous() for k, v in sorted(state.items())}
            self._adapter_params = {k: p for k, p in sorted(found.items()) if p is not None}
        return {k: full(p.detach()).to("cpu").contiguous() for k, p in self._adapter_params.items()}

    def rebind_parameters(self) -> None:
        """Read the trainable parameters again after a wrapper replaced them under the same names
        (``fully_shard``, :func:`replayjob.runtime.distributed.wrap`); the adapter's name map follows them."""
        self.adapter_state()  # the weight-file name -> parameter map, built on the parameters being replaced
        live = dict(self.model.named_parameters())
        names = {id(p): n for n, p in self._trainable}
        if self._adapter_params is not None:
            self._adapter_params = {k: live[names[id(p)]] for k, p in self._adapter_params.items()}
        self._trainable = [(n, live[n]) for n, _ in self._trainable]

    def save_adapter(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        weights = directory / ADAPTER_WEIGHTS
        atomic_write_bytes(weights, adapter_bytes(self.adapter_state()))
        pcfg = self.model.peft_config["default"].to_dict()
        pcfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in pcfg.items()}
        atomic_write_bytes(directory / ADAPTER_CONFIG, pretty_bytes(_jsonable(pcfg)))
        return weights

    def load_adapter(self, weight_file: Path, expected_sha256: str | None = None) -> None:
        from peft import set_peft_model_state_dict


        # one read: the pin is checked over the very bytes the tensors are built from, and the
        # file is validated before that (pickle and malformed files refused)
        loaded = tensorfile.load(weight_file, expected_sha256=expected_sha256)
        expected = self.adapter_state()
        if set(loaded) != set(expected):
            missing = sorted(set(expected) - set(loaded))[:3]
            extra = sorted(set(loaded) - set(expected))[:3]
            raise ContractError(f"adapter tensors do not match this model (missing {missing}, "
                                f"unexpected {extra})", where=weight_file,
                                hint="check lora.r, lora.target_modules and the base model")
        for k, v in loaded.items():
            if v.shape != expected[k].shape or v.dtype != expected[k].dtype:
                raise ContractError(f"adapter tensor {k} is {v.dtype}{list(v.shape)}, model expects "
                                    f"{expected[k].dtype}{list(expected[k].shape)}", where=weight_file)
        set_peft_model_state_dict(self.model, loaded)

    def model_reference(self) -> dict[str, Any]:
        return builtin_model_reference(self.cfg)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return str(obj)


_LORA_WEIGHT = re.compile(r"(.+)\.lora_([AB])\.weight")


def adapter_layout_reasons(cfg: Config, layout: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """Why an adapter file of this layout (each tensor's dtype and shape) cannot be the LoRA adapter
    :meth:`HFBackend.build` attaches for ``cfg``, told from the config alone: every tensor a ``lora_A`` or
    ``lora_B`` weight of a module ``lora.target_modules`` names, both present for each module, of the model's
    dtype, ``lora_A`` of ``lora.r`` rows and ``lora_B`` of ``lora.r`` columns.  Which modules the model has and their
    widths only the built model tells (:meth:`HFPolicy.load_adapter` compares every tensor with it)."""
    reasons: list[str] = []
    want, r, targets = f"torch.{cfg.model.dtype}", cfg.lora.r, list(cfg.lora.target_modules)
    halves: dict[str, set[str]] = {}
    for name, (dtype, shape) in sorted(layout.items()):
        found = _LORA_WEIGHT.fullmatch(name)
        if found is None:
            reasons.append(f"tensor {name[:80]!r} is not a LoRA weight (<module>.lora_A.weight or .lora_B.weight)")
            continue
        module, half = found.groups()
        halves.setdefault(module, set()).add(half)
        if not any(module == t or module.endswith("." + t) for t in targets):
            reasons.append(f"tensor {name[:80]} adapts a module lora.target_modules does not name ({targets})")
        if dtype != want:
            reasons.append(f"tensor {name[:80]} is {dtype}, the model's dtype is {want} (model.dtype)")
        if len(shape) != 2 or shape[0 if half == "A" else 1] != r:
            reasons.append(f"tensor {name[:80]} has shape {list(shape)}; lora_{half} has lora.r = {r} "
                           f"{'rows' if half == 'A' else 'columns'}")
    for module, have in sorted(halves.items()):
        if have != {"A", "B"}:
            reasons.append(f"module {module[:80]} has lora_{''.join(sorted(have))} without "
                           f"lora_{''.join(sorted({'A', 'B'} - have))}")
    return reasons


class HFBackend:
    name = "hf"

    def model_reference(self, cfg: Config) -> dict[str, Any]:
        """The reference of the model :meth:`build` builds from ``cfg``, without building it."""
        return builtin_model_reference(cfg)

    def vocab_size(self, cfg: Config) -> int | None:
        """The input embedding's rows of the model :meth:`build` builds, where the config alone tells them: the
        built-in models' (the byte tokenizer's); None for a local model (the replay compares with the built one)."""
        return None if cfg.model.path else ByteTokenizer.vocab_size

    def adapter_reasons(self, cfg: Config, layout: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
        """Why an adapter of ``layout`` cannot load into the model :meth:`build` builds
        (:func:`adapter_layout_reasons`)."""
        return adapter_layout_reasons(cfg, layout)

    def build(self, cfg: Config) -> HFPolicy:
        import torch
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")
        from peft import LoraConfig, get_peft_model

        device = torch.device(cfg.backend.torch_device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"backend.devices = {cfg.backend.devices!r} but no CUDA device is visible",
                              where="backend.devices", hint="use devices = \"cpu\" on this machine")
        dtype = getattr(torch, cfg.model.dtype)  # float32, bfloat16 or float16 (the schema's choices)
        attn = cfg.backend.options.attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.model.init_seed)
            base, tokenizer = _base_model(cfg, attn, dtype)
            base.config.use_cache = False
            lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                              target_modules=list(cfg.lora.target_modules), bias="none",
                              task_type="CAUSAL_LM")
            torch.manual_seed(cfg.training.seed if cfg.training.seed is not None else 0)
            try:
                model = get_peft_model(base, lcfg)
            except ValueError as exc:
                raise ConfigError(f"cannot attach LoRA: {exc}", where="lora.target_modules") from None
        model.to(device=device, dtype=dtype)
        if cfg.backend.options.gradient_checkpointing:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return HFPolicy(model, tokenizer, device, cfg)


def _base_model(cfg: Config, attn: str, dtype: torch.dtype) -> tuple[Any, Tokenizer]:
    if not cfg.model.path and cfg.model.architecture == "qwen3_moe":
        return moe.tiny_model(cfg, attn), ByteTokenizer()
    if not cfg.model.path:
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = ByteTokenizer()
        mc = cfg.model
        lcfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=mc.hidden_size,
                           intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
                           num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
                           max_position_embeddings=mc.max_position_embeddings,
                           pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                           tie_word_embeddings=False, attn_implementation=attn)  # type: ignore[call-arg]
        return LlamaForCausalLM(lcfg), tok
    return _local_model(Path(cfg.model.path), attn, dtype, cfg)


def _local_model(path: Path, attn: str, dtype: torch.dtype, cfg: Config) -> tuple[Any, Tokenizer]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ConfigError("not a model directory (no config.json)", where=path,
                          hint="point model.path at a local transformers model directory")
    if not any(path.glob("*.safetensors")):
        raise ConfigError("no safetensors weights in the model directory; pickle weights are "
                          "never loaded", where=path,
                          hint="convert the checkpoint to safetensors (save_pretrained(safe_serialization=True))")
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, use_safetensors=True,
                                                 dtype=dtype, attn_implementation=attn)
    moe.set_experts_implementation(model, cfg.model.experts_implementation)
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return model, HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    if model.config.vocab_size >= ByteTokenizer.vocab_size:
        return model, ByteTokenizer()
    raise ConfigError("model directory has no tokenizer and its vocabulary is too small for the "
                      "built-in byte tokenizer", where=path)
