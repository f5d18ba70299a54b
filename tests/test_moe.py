"""Mixture-of-experts routing on the built-in tiny Qwen3-MoE model (CPU): routing observed, captured and forced.

Every run here is real: ``replayjob init`` / ``capture`` / ``replay`` through ``replayjob.cli.main`` on a
transformers Qwen3-MoE model with a peft LoRA adapter built from config (two MoE layers, four experts,
top-2).  One capture and its replays are shared by the module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MOE, replay_pins

from replayjob.artifacts.trace_store import read_trace
from replayjob.cli import main
from replayjob.config import load_config
from replayjob.errors import ConfigError, IntegrityError
from replayjob.model import moe
from replayjob.model.backend import load_backend
from replayjob.producers import trace_fault as fault

FLIP_SCALE = "2e-3"  # flips the expert set of the few tokens whose router-logit margin is about 4e-3 or less
ATTENTION = "base_model.model.model.layers.0.self_attn.o_proj"


def forced(routing_file: Path, sha: str) -> list[str]:
    return ["--set", 'model.routing="forced"', "--set", 'optimizer_batch.allow_config_differences=["model.routing"]',
            "--set", f'optimizer_batch.routing_path="{routing_file}"',
            "--set", f'optimizer_batch.routing_sha256="{sha}"']


def metrics(d: Path, name: str = "replay_metrics.json") -> dict[str, Any]:
    return json.loads((d / name).read_text())


@pytest.fixture(scope="module")
def moe_runs(moe_workspace: Path) -> dict[str, Any]:
    d = moe_workspace
    src = d / "source"
    entry = metrics(src, "metrics.json")["routing/steps"][0]
    out: dict[str, Any] = {"ws": d, "source": src, "routing_file": src / entry["path"], "routing_sha": entry["sha256"]}

    def replay(name: str, *extra: str) -> Path:
        assert main(["replay", str(d / "replay.toml"), "--out", str(d / name), *replay_pins(src), *MOE, *extra]) == 0
        return d / name

    out["free"] = replay("free", "--trace")
    out["free_again"] = replay("free_again", "--trace", "--repeat-index", "1")  # a same-condition repeat
    out["batched"] = replay("batched", "--trace", "--set", 'model.experts_implementation="batched_mm"',
                            "--set", 'optimizer_batch.allow_config_differences=["model.experts_implementation"]')
    out["forced"] = replay("forced", "--trace", *forced(out["routing_file"], out["routing_sha"]))
    os.environ[moe.FAULT_ENV] = FLIP_SCALE
    try:  # the perturbed arm: its only effect is a handful of routing flips, then the same arm with routing forced
        out["flips"] = replay("flips", "--trace", "--repeat-index", "1")
        out["flips_forced"] = replay("flips_forced", "--trace", "--repeat-index", "1",
                                     *forced(out["routing_file"], out["routing_sha"]))
        both = '["model.routing", "backend.options.gradient_checkpointing"]'
        gc_forced = [*forced(out["routing_file"], out["routing_sha"])[:2],
                     "--set", f"optimizer_batch.allow_config_differences={both}",
                     *forced(out["routing_file"], out["routing_sha"])[4:],
                     "--set", "backend.options.gradient_checkpointing=true"]
        out["flips_forced_gc"] = replay("flips_forced_gc", "--repeat-index", "1", *gc_forced)
    finally:
        del os.environ[moe.FAULT_ENV]
    fault.configure(f"{ATTENTION}:1e-3")
    try:  # a numerical difference upstream of the routers, with routing held fixed
        out["numeric_forced"] = replay("numeric_forced", "--trace", "--repeat-index", "2",
                                       *forced(out["routing_file"], out["routing_sha"]))
    finally:
        fault.configure()
    return out


def test_tiny_moe_model_is_built_from_config() -> None:
    cfg = load_config(None, ['model.architecture="qwen3_moe"', "training.seed=1", "model.num_experts=6",
                             "model.num_experts_per_tok=3"])
    policy = load_backend("hf").build(cfg)
    base = policy.model.get_base_model()
    assert type(base).__name__ == "Qwen3MoeForCausalLM" and base.config.num_experts == 6
    assert policy.routing is not None and policy.routing.top_k == 3 and len(policy.routing.names) == 2
    assert all(".lora_" in n for n, _ in policy.trainable())  # experts and routers stay frozen; LoRA trains
    assert policy.model_reference()["architecture"] == "qwen3_moe"
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(None, ['model.architecture="qwen3_moe"', "model.num_experts_per_tok=4"])


def test_dense_model_has_no_routing_and_refuses_forcing() -> None:
    dense = load_backend("hf").build(load_config(None, ["training.seed=1"]))
    assert dense.routing is None and "architecture" not in dense.model_reference()  # earlier states still match
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        load_backend("hf").build(load_config(None, ["training.seed=1", 'model.routing="forced"']))


def test_capture_records_the_source_steps_routing(moe_runs: dict[str, Any]) -> None:
    m = metrics(moe_runs["source"], "metrics.json")
    assert m["routing/steps"][0]["step"] == 0
    assert hashlib.sha256(moe_runs["routing_file"].read_bytes()).hexdigest() == moe_runs["routing_sha"]
    t = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    assert t.identity == {"logical_batch_sha256": m["optimizer/logical_batch_sha256"]}
    assert [lay.name for lay in t.layers] == [f"base_model.model.model.layers.{i}.mlp.gate" for i in (0, 1)]
    assert t.top_k == 2 and t.num_experts == 4 and t.mode == "free" and t.fault is None
    for lay in t.layers:
        assert lay.experts.shape == (t.tokens, 2) and not bool(lay.forced.any())
        assert torch.allclose(lay.weights.sum(-1), torch.ones(t.tokens))  # normalised top-2 weights
        assert bool((lay.margin >= 0).all())


def test_same_condition_replay_is_bitwise_and_pins_its_routing(moe_runs: dict[str, Any]) -> None:
    src, r = metrics(moe_runs["source"], "metrics.json"), metrics(moe_runs["free"])
    assert r["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    assert r["loss"] == src["loss"]
    pin = r["routing"]
    assert pin["path"] == "routing.safetensors"
    assert hashlib.sha256((moe_runs["free"] / pin["path"]).read_bytes()).hexdigest() == pin["sha256"]
    mine = moe.read_table(moe_runs["free"] / pin["path"], pin["sha256"])
    theirs = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    assert mine.identity["manifest_sha256"] == r["optimizer_batch/manifest_sha256"]
    assert torch.equal(mine.row_tokens, theirs.row_tokens)
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        assert torch.equal(a.experts, b.experts) and torch.equal(a.weights, b.weights)
        assert torch.equal(a.margin, b.margin)


def test_forced_replay_of_the_source_routing_is_bitwise(moe_runs: dict[str, Any]) -> None:
    src, r = metrics(moe_runs["source"], "metrics.json"), metrics(moe_runs["forced"])
    assert r["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    assert r["runtime"]["model.routing"] == "forced" and metrics(moe_runs["free"])["runtime"]["model.routing"] == "free"
    t = moe.read_table(moe_runs["forced"] / "routing.safetensors", r["routing"]["sha256"])
    assert t.mode == "forced" and not any(bool(lay.forced.any()) for lay in t.layers)


def test_forcing_other_experts_routes_there(moe_runs: dict[str, Any], tmp_path: Path) -> None:
    """The rule's own test: a forced table that differs at one token routes that token (and only it) there."""
    base = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    lay = base.layers[1]
    token = int(lay.margin.argmax())  # far from a tie: the free router never picks the forced set here
    experts = lay.experts.clone()
    unused = [e for e in range(base.num_experts) if e not in experts[token].tolist()]
    experts[token] = torch.tensor(unused[:2])
    changed = dataclasses.replace(base, layers=[base.layers[0], dataclasses.replace(lay, experts=experts)])
    path = tmp_path / "changed.safetensors"
    sha = moe.write_table(path, changed)
    out = tmp_path / "r"
    assert main(["replay", str(moe_runs["ws"] / "replay.toml"), "--out", str(out), *replay_pins(moe_runs["source"]),
                 *MOE, *forced(path, sha)]) == 0
    r = metrics(out)
    assert r["optimizer_batch/final_adapter_sha256"] != metrics(moe_runs["source"], "metrics.json")[
        "optimizer_batch/final_adapter_sha256"]
    got = moe.read_table(out / "routing.safetensors", r["routing"]["sha256"])
    assert got.layers[1].forced.nonzero().flatten().tolist() == [token]
    assert sorted(got.layers[1].experts[token].tolist()) == sorted(unused[:2])
    assert torch.equal(got.layers[0].experts, base.layers[0].experts)


def free_and_forced_gradients(sets: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One forward and backward of a policy built from ``sets`` with its routing recorded, then of a second
    one with that routing forced: the router weights' and LoRA gradients of each."""
    cfg = load_config(None, [*sets, "training.seed=1"])
    ids = torch.randint(3, 200, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0

    def run(policy: Any) -> dict[str, torch.Tensor]:
        routing = policy.routing
        for m in routing.modules:
            m.weight.requires_grad_(True)
        routing.begin_update()
        with routing.micro_batch([0, 1, 2], mask):
            policy.model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
        routing.end_update()
        grads = {f"router{i}": m.weight.grad.clone() for i, m in enumerate(routing.modules)}
        grads.update({n: p.grad.clone() for n, p in policy.trainable()})
        return grads

    free_policy = load_backend("hf").build(cfg)
    free = run(free_policy)
    table = free_policy.routing.last
    assert table is not None and table.tokens == int(mask.sum())
    forced_policy = load_backend("hf").build(cfg)
    forced_policy.routing.mode, forced_policy.routing.table = "forced", table  # as attach() sets it up
    forced_policy.routing._row_offsets = [0, *table.row_tokens.cumsum(0).tolist()]
    for i, m in enumerate(forced_policy.routing.modules):
        m.forward = lambda hs, i=i, m=m: forced_policy.routing._routed(i, m, hs)
    return free, run(forced_policy)


def test_forced_router_keeps_its_gradient_bitwise() -> None:
    """Forcing the router's own choice: the router weight's gradient (through the recomputed weights) and
    the LoRA gradients are bitwise the free forward's."""
    free, got = free_and_forced_gradients(['model.architecture="qwen3_moe"'])
    assert all(float(g.abs().sum()) > 0 for k, g in free.items() if k.startswith("router"))
    assert free.keys() == got.keys() and all(torch.equal(free[k], got[k]) for k in free)


@pytest.mark.parametrize("kind", ["mixtral", "olmoe"])
def test_a_local_moe_model_is_observed_and_forced(kind: str, tmp_path: Path) -> None:
    """A transformers MoE model directory (safetensors) of another class: its routers are found, and forcing
    their own routing is bitwise the free forward and backward."""
    from transformers import MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM

    common = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = OlmoeForCausalLM(OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(tmp_path / kind, safe_serialization=True)
    free, got = free_and_forced_gradients([f'model.path="{tmp_path / kind}"'])
    assert sum(k.startswith("router") for k in free) == 2
    assert free.keys() == got.keys() and all(torch.equal(free[k], got[k]) for k in free)


def hostile_routing_file(case: str, t: moe.RoutingTable, good: Path, sha: str, path: Path) -> str:
    """Write at ``path`` the routing file of ``case`` (``missing``: none) made from the valid table ``t`` (its file
    ``good``, pinned by ``sha``), and return the SHA-256 a replay would pin for it."""
    if case == "tampered":  # the pinned digest of other bytes
        data = bytearray(good.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    elif case == "fewer tokens":  # the last row one token short: a consistent file, pinned, of other rows
        rt = t.row_tokens.clone()
        rt[-1] -= 1
        short = [moe.LayerRouting(lay.name, lay.experts[:-1], lay.weights[:-1], lay.margin[:-1], lay.forced[:-1])
                 for lay in t.layers]
        return moe.write_table(path, dataclasses.replace(t, row_tokens=rt, layers=short))
    elif case == "another model":  # a third router
        return moe.write_table(path, dataclasses.replace(t, layers=[*t.layers, dataclasses.replace(t.layers[1],
                                                                                                    name="extra")]))
    return sha


def test_forcing_without_a_pinned_file_is_refused(moe_runs: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    cfg, pins = str(moe_runs["ws"] / "replay.toml"), replay_pins(moe_runs["source"])
    rc = main(["replay", cfg, "--out", str(tmp_path / "a"), *pins, *MOE, "--set", 'model.routing="forced"',
               "--set", 'optimizer_batch.allow_config_differences=["model.routing"]'])
    assert rc == 2 and "routing_path" in capsys.readouterr().err
    rc = main(["replay", cfg, "--out", str(tmp_path / "b"), *pins, *MOE,
               *forced(moe_runs["routing_file"], "0" * 64)])
    assert rc == 2 and "SHA-256" in capsys.readouterr().err
    rc = main(["replay", cfg, "--out", str(tmp_path / "c"), *pins, *MOE, "--set", 'model.routing="forced"'])
    assert rc == 2 and "model.routing" in capsys.readouterr().err  # an undeclared difference


@pytest.mark.parametrize("case", ["missing", "tampered", "fewer tokens", "another model"])
def test_explain_checks_the_forced_routing_file_before_any_model(case: str, moe_runs: dict[str, Any], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced replay's routing file that is missing, not the pinned bytes, or of another shape than the capture's
    rows or the model's routers is refused by explain (exit 2, every reason, no traceback); no model is built."""
    def no_model(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a model was built")
    monkeypatch.setattr(moe, "tiny_model", no_model)
    cfg, pins = str(moe_runs["ws"] / "replay.toml"), replay_pins(moe_runs["source"])
    assert main(["explain", cfg, *pins, *MOE, *forced(moe_runs["routing_file"], moe_runs["routing_sha"])]) == 0
    t = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    path = tmp_path / "routing.safetensors"
    sha = hostile_routing_file(case, t, moe_runs["routing_file"], moe_runs["routing_sha"], path)
    capsys.readouterr()
    rc = main(["explain", cfg, *pins, *MOE, *forced(path, sha)])
    err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err.err
    text = err.out + err.err
    assert {"missing": "no routing file here", "tampered": "SHA-256",
            "fewer tokens": f"holds {t.row_tokens.numel()} rows of {t.tokens - 1} tokens that are not",
            "another model": "routes 3 layers top-2 of 4 experts; this model has 2 MoE layers"}[case] in text


def test_routing_file_reader_fails_closed(moe_runs: dict[str, Any], tmp_path: Path) -> None:
    t = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    bad = t.layers[0].experts.clone()
    bad[0, 0] = t.num_experts  # no such expert
    path = tmp_path / "bad.safetensors"
    moe.write_table(path, dataclasses.replace(t, layers=[dataclasses.replace(t.layers[0], experts=bad), t.layers[1]]))
    with pytest.raises(IntegrityError, match="outside"):
        moe.read_table(path, None)
    twice = t.layers[0].experts.clone()
    twice[0, 1] = twice[0, 0]
    path = tmp_path / "twice.safetensors"
    moe.write_table(path, dataclasses.replace(t, layers=[dataclasses.replace(t.layers[0], experts=twice), t.layers[1]]))
    with pytest.raises(IntegrityError, match="twice"):
        moe.read_table(path, None)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(moe_runs["routing_file"], copy)
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="SHA-256"):
        moe.read_table(copy, moe_runs["routing_sha"])


def routing_bytes(t: moe.RoutingTable, meta: dict[str, str] | None = None, **layer0: torch.Tensor) -> bytes:
    """A routing file of ``t`` with metadata entries replaced by ``meta`` and the first router's tensors by
    ``layer0`` (``experts``, ``weights``, ``margin``, ``forced``), encoded without the writer's checks."""
    from replayjob import tensorfile
    tensors = {"rows.tokens": t.row_tokens}
    for k, lay in enumerate(t.layers):
        for f in ("experts", "weights", "margin", "forced"):
            tensors[f"layer.{k:04d}.{f}"] = layer0.get(f, getattr(lay, f)) if k == 0 else getattr(lay, f)
    doc = {"format": moe.ROUTING_SCHEMA, "layers": json.dumps([lay.name for lay in t.layers]), "top_k": str(t.top_k),
           "num_experts": str(t.num_experts), "mode": t.mode, "fault": t.fault or "",
           "identity": json.dumps(t.identity), **(meta or {})}
    return tensorfile.encode({k: v.contiguous() for k, v in tensors.items()}, metadata=doc,
                             schema=moe._schema(len(t.layers))).data


def _set(x: torch.Tensor, at: tuple[int, ...], value: float | bool) -> torch.Tensor:
    y = x.clone()
    y[at] = value
    return y


HOSTILE_TABLES: dict[str, Any] = {  # each a value or a field no recorded routing holds, refused by the reader
    "margin NaN": lambda t: routing_bytes(t, margin=_set(t.layers[0].margin, (0,), float("nan"))),
    "margin infinite": lambda t: routing_bytes(t, margin=_set(t.layers[0].margin, (0,), float("inf"))),
    "margin negative": lambda t: routing_bytes(t, margin=_set(t.layers[0].margin, (5,), -1.0)),
    "weight negative": lambda t: routing_bytes(t, weights=_set(t.layers[0].weights, (0, 0), -5.0)),
    "forced tokens under free routing": lambda t: routing_bytes(t, forced=_set(t.layers[0].forced, (3,), True)),
    "router name with an escape": lambda t: routing_bytes(t, {"layers": json.dumps(
        ["a\n\u001b[31m", t.layers[1].name])}),
    "fault with an escape": lambda t: routing_bytes(t, {"fault": "\x1b[2J"}),
    "layers nested deep": lambda t: routing_bytes(t, {"layers": "[" * 100000 + "]" * 100000}),
    "layers NaN literal": lambda t: routing_bytes(t, {"layers": '["a", NaN]'}),
    "no router": lambda t: routing_bytes(dataclasses.replace(t, layers=[]), {"layers": "[]"}),
    "top_k not canonical": lambda t: routing_bytes(t, {"top_k": "0_2"}),
    "top_k padded": lambda t: routing_bytes(t, {"top_k": " 2 "}),
    "no identity": lambda t: routing_bytes(t, {"identity": "{}"}),
    "identity not a digest": lambda t: routing_bytes(t, {"identity": json.dumps({"logical_batch_sha256": "x"})}),
    "row counts wrapping 64 bits": lambda t: routing_bytes(dataclasses.replace(
        t, row_tokens=torch.tensor([2 ** 62] * 4 + [0] * (t.row_tokens.numel() - 4)),
        layers=[dataclasses.replace(lay, experts=lay.experts[:0], weights=lay.weights[:0], margin=lay.margin[:0],
                                    forced=lay.forced[:0]) for lay in t.layers])),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TABLES))
def test_routing_file_reader_refuses_what_no_router_records(case: str, moe_runs: dict[str, Any],
                                                            tmp_path: Path) -> None:
    """A routing file whose pin is right but whose content no recorded routing can hold (a margin or weight out of
    range, forced tokens under free routing, an unprintable name, malformed or non-canonical metadata, row counts
    that wrap past 64 bits) is refused by the reader with a refusal, never a crash."""
    t = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    data = HOSTILE_TABLES[case](t)
    path = tmp_path / "routing.safetensors"
    path.write_bytes(data)
    with pytest.raises(IntegrityError, match="routing file refused"):
        moe.read_table(path, hashlib.sha256(data).hexdigest())


def test_a_resealed_routing_file_with_a_nan_margin_is_refused_by_trace_diff(
        moe_runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "flips"
    shutil.copytree(moe_runs["flips"], d)
    t = moe.read_table(d / "routing.safetensors", None)
    data = routing_bytes(t, margin=_set(t.layers[0].margin, (0,), float("nan")))
    (d / "routing.safetensors").unlink()
    (d / "routing.safetensors").write_bytes(data)
    doc = metrics(d)
    doc["routing"]["sha256"] = hashlib.sha256(data).hexdigest()
    (d / "replay_metrics.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["trace-diff", str(moe_runs["free"]), str(d), "--json"]) == 2
    err = capsys.readouterr().err
    assert "router-logit margin" in err and "Traceback" not in err


def reseal_routing(d: Path, meta: dict[str, str]) -> None:
    """Replace the replay ``d``'s routing file by its own table with metadata entries ``meta`` and re-pin it in
    replay_metrics.json, as someone rewriting both would."""
    t = moe.read_table(d / "routing.safetensors", None)
    data = routing_bytes(t, meta)
    (d / "routing.safetensors").unlink()
    (d / "routing.safetensors").write_bytes(data)
    doc = metrics(d)
    doc["routing"]["sha256"] = hashlib.sha256(data).hexdigest()
    (d / "replay_metrics.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("field", ["logical_batch_sha256", "manifest_sha256", "mode"])
def test_a_routing_file_of_another_replay_is_refused(field: str, moe_runs: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A routing file re-pinned in a replay's replay_metrics.json must be that replay's: recorded on its logical batch
    and manifest, in the routing mode its runtime records; another is refused (exit 2), not compared."""
    d = tmp_path / "flips"
    shutil.copytree(moe_runs["flips"], d)
    identity = dict(moe.read_table(d / "routing.safetensors", None).identity)
    meta = {"mode": "forced"} if field == "mode" else {"identity": json.dumps({**identity, field: "ab" * 32})}
    reseal_routing(d, meta)
    capsys.readouterr()
    assert main(["trace-diff", str(moe_runs["free"]), str(d)]) == 2
    err = capsys.readouterr().err
    assert "the routing file is not this replay's" in err and field in err and "Traceback" not in err


def test_a_routing_file_of_other_rows_than_the_trace_is_refused(moe_runs: dict[str, Any], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A replay's routing file and trace count the same real tokens per row; a routing file of the replay's own
    identity re-sealed over other rows (the last row a token short) is refused (exit 2) where both are read
    (load_side: trace-diff, and reduce's routing check, which attributes flips through the traces)."""
    from replayjob.trace.diff import load_side

    d = tmp_path / "flips"
    shutil.copytree(moe_runs["flips"], d)
    t = moe.read_table(d / "routing.safetensors", None)
    (d / "routing.safetensors").unlink()
    sha = hostile_routing_file("fewer tokens", t, d, "", d / "routing.safetensors")
    doc = metrics(d)
    doc["routing"]["sha256"] = sha
    (d / "replay_metrics.json").write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="count different tokens per row"):
        load_side(d)
    capsys.readouterr()
    assert main(["trace-diff", str(moe_runs["free"]), str(d)]) == 2
    err = capsys.readouterr().err
    assert "count different tokens per row" in err and "Traceback" not in err


def trace_diff(capsys: pytest.CaptureFixture[str], a: Path, b: Path) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = main(["trace-diff", str(a), str(b), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_same_condition_trace_diff_reports_identical_routing(moe_runs: dict[str, Any],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = trace_diff(capsys, moe_runs["free"], moe_runs["forced"])
    assert rc == 0 and rep["routing"]["attribution"] == "identical" and rep["routing"]["flipped"] == 0
    assert rep["routing"]["mode_a"] == "free" and rep["routing"]["mode_b"] == "forced"


def test_routing_flips_are_located_to_layer_and_token(moe_runs: dict[str, Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = trace_diff(capsys, moe_runs["free"], moe_runs["flips"])
    rt = rep["routing"]
    assert rc == 1 and rt["attribution"] == "downstream-of-flips" and rt["fault_b"] == repr(float(FLIP_SCALE))
    assert 0 < rt["flipped"] <= 10  # a handful
    first = rt["first_flip"]
    block = first["layer"].rsplit(".", 1)[0]
    assert rt["flip_block"] == block and first["margin_a"] < 4 * float(FLIP_SCALE)
    assert sorted(first["experts_a"]) != sorted(first["experts_b"])
    # the trace, read on its own, agrees: nothing differs before the flipped layer's MoE block, and the block's
    # output first differs at exactly the flipped row and token
    fwd = rep["first_divergence"]["forward"]
    assert fwd["name"] == block and fwd["first_row"] == first["row"]
    assert all(r["status"] == "equal" for r in rep["forward"] if r["position"] < fwd["position"])
    ta, tb = read_trace(moe_runs["free"]), read_trace(moe_runs["flips"])
    va = next(s.values for s in ta.forward if s.name == block)
    vb = next(s.values for s in tb.forward if s.name == block)
    differs = (va != vb).any(dim=-1).nonzero().flatten().tolist()
    assert differs[0] == first["position"]
    assert first["token"] == first["position"] - int(ta.row_tokens[:first["row"]].sum())
    layer = next(lay for lay in rt["layers"] if lay["layer"] == first["layer"])
    assert layer["share"] == pytest.approx(layer["flipped"] / layer["tokens"])
    assert layer["weights_max_abs_unflipped"] == 0.0  # in the flipped layer only the flipped tokens changed


def test_forcing_the_source_routing_removes_the_flips(moe_runs: dict[str, Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    src = metrics(moe_runs["source"], "metrics.json")
    r = metrics(moe_runs["flips_forced"])
    assert r["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    rc, rep = trace_diff(capsys, moe_runs["free"], moe_runs["flips_forced"])
    assert rc == 0 and rep["routing"]["flipped"] == 0
    # where the perturbed router would have chosen otherwise, forcing kept the source's experts: in the first
    # flipped layer exactly the tokens the free perturbed arm flipped
    first = trace_diff(capsys, moe_runs["free"], moe_runs["flips"])[1]["routing"]["first_flip"]
    t_forced = moe.read_table(moe_runs["flips_forced"] / "routing.safetensors", r["routing"]["sha256"])
    t_free = moe.read_table(moe_runs["flips"] / "routing.safetensors", metrics(moe_runs["flips"])["routing"]["sha256"])
    t_src = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    k = [lay.name for lay in t_src.layers].index(first["layer"])
    flipped = (t_src.layers[k].expert_sets() != t_free.layers[k].expert_sets()).any(-1)
    assert torch.equal(t_forced.layers[k].forced, flipped)


def test_a_numerical_difference_with_routing_held_is_named(moe_runs: dict[str, Any],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = trace_diff(capsys, moe_runs["forced"], moe_runs["numeric_forced"])
    assert rc == 1 and rep["routing"]["flipped"] == 0 and rep["routing"]["attribution"] == "identical-routing"
    assert rep["first_divergence"]["forward"]["name"] == ATTENTION
    capsys.readouterr()
    assert main(["trace-diff", str(moe_runs["free"]), str(moe_runs["flips"])]) == 1
    text = capsys.readouterr().out
    assert "differs only downstream of routing flips" in text and "first flip: layer 0" in text


def test_a_difference_upstream_of_the_flips_is_named(moe_runs: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    fault.configure(f"{ATTENTION}:0.05")
    try:
        assert main(["replay", str(moe_runs["ws"] / "replay.toml"), "--out", str(tmp_path / "r"),
                     *replay_pins(moe_runs["source"]), *MOE, "--trace"]) == 0
    finally:
        fault.configure()
    rc, rep = trace_diff(capsys, moe_runs["free"], tmp_path / "r")
    assert rc == 1 and rep["routing"]["flipped"] > 0 and rep["routing"]["attribution"] == "upstream-of-flips"


def test_routing_evidence_is_verified_against_its_pin(moe_runs: dict[str, Any], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "flips"
    shutil.copytree(moe_runs["flips"], d)
    data = bytearray((d / "routing.safetensors").read_bytes())
    data[-1] ^= 1
    (d / "routing.safetensors").write_bytes(bytes(data))
    assert main(["trace-diff", str(moe_runs["free"]), str(d)]) == 2
    assert "SHA-256" in capsys.readouterr().err
    (d / "routing.safetensors").unlink()
    assert main(["trace-diff", str(moe_runs["free"]), str(d)]) == 2
    assert "routing" in capsys.readouterr().err
    shutil.copy(moe_runs["flips"] / "routing.safetensors", d / "routing.safetensors")
    doc = metrics(d)
    doc["routing"]["path"] = "../routing.safetensors"
    (d / "replay_metrics.json").write_text(json.dumps(doc))
    assert main(["trace-diff", str(moe_runs["free"]), str(d)]) == 2
    assert "routing" in capsys.readouterr().err  # a path outside the fixed layout is refused
    del doc["routing"]  # one side without routing evidence: not comparable as an MoE pair
    (d / "replay_metrics.json").write_text(json.dumps(doc))
    assert main(["trace-diff", str(moe_runs["free"]), str(d)]) == 2
    assert "only one of the replays recorded its routing" in capsys.readouterr().err


def test_experts_kernel_arm_is_judged_with_routing_held(moe_runs: dict[str, Any],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' batched-matmul experts against the eager loop: the kernel is observed in effect, every
    token keeps its experts, and what differs (summation order only) stays within the rounding envelope."""
    r = metrics(moe_runs["batched"])
    assert r["runtime"]["model.experts_implementation"] == "batched_mm"
    assert metrics(moe_runs["free"])["runtime"]["model.experts_implementation"] == "eager"
    rc, rep = trace_diff(capsys, moe_runs["free"], moe_runs["batched"])
    assert rep["routing"]["flipped"] == 0 and rep["classification"] in ("equal", "noise")
    assert rep["routing"]["attribution"] == ("identical" if rc == 0 else "identical-routing")


@pytest.mark.slow
def test_router_loss_is_part_of_the_contract_and_the_update(moe_runs: dict[str, Any], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    aux = ["--set", "model.router_aux_loss_coef=0.01"]
    src = tmp_path / "source"
    assert main(["capture", str(moe_runs["ws"] / "source.toml"), "--out", str(src), *MOE, *aux]) == 0
    m, plain = metrics(src, "metrics.json"), metrics(moe_runs["source"], "metrics.json")
    assert m["optimizer/logical_batch_sha256"] == plain["optimizer/logical_batch_sha256"]  # the same rows
    assert m["loss"] > plain["loss"]  # the load-balancing term is positive
    assert m["optimizer_batch/final_adapter_sha256"] != plain["optimizer_batch/final_adapter_sha256"]
    manifest = json.loads((src / m["optimizer_batch/manifest_path"]).read_text())
    assert manifest["contract"]["value"]["loss"]["router_aux_loss_coef"] == 0.01
    cfg = str(moe_runs["ws"] / "replay.toml")
    aux += ["--set", f'optimizer_batch.replay_path="{src / m["optimizer_batch/manifest_path"]}"']
    assert main(["replay", cfg, "--out", str(tmp_path / "same"), *replay_pins(src), *MOE, *aux]) == 0
    same = metrics(tmp_path / "same")
    assert same["optimizer_batch/final_adapter_sha256"] == m["optimizer_batch/final_adapter_sha256"]
    capsys.readouterr()
    assert main(["replay", cfg, "--out", str(tmp_path / "off"), *replay_pins(src), *MOE, *aux[2:]]) == 2
    assert "router_aux_loss_coef" in capsys.readouterr().err
    assert main(["replay", cfg, "--out", str(tmp_path / "mb1"), *replay_pins(src), *MOE, *aux,
                 "--set", "training.micro_batch_size=1",
                 "--set", 'optimizer_batch.allow_config_differences=["training.micro_batch_size"]']) == 2
    assert "load-balancing loss computed per micro-batch" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no router"):
        load_backend("hf").build(load_config(None, ["training.seed=1", "model.router_aux_loss_coef=0.01"]))


def test_forced_routing_holds_through_checkpointing_recomputation(moe_runs: dict[str, Any]) -> None:
    """Under gradient checkpointing each layer's forward, routers included, runs again in backward: the
    forced experts hold there too (the perturbed router would flip tokens otherwise), so the update is
    still bitwise the source's, and the routing is recorded once per micro-batch."""
    src, r = metrics(moe_runs["source"], "metrics.json"), metrics(moe_runs["flips_forced_gc"])
    assert r["runtime"]["backend.options.gradient_checkpointing"] is True
    assert r["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    t = moe.read_table(moe_runs["flips_forced_gc"] / "routing.safetensors", r["routing"]["sha256"])
    base = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    assert t.tokens == base.tokens and any(bool(lay.forced.any()) for lay in t.layers)
    assert all(torch.equal(a.experts, b.experts) for a, b in zip(t.layers, base.layers, strict=True))


def test_routing_table_is_in_logical_row_order_whatever_the_micro_batches() -> None:
    """Rows recorded in micro-batches out of order (or of another size) land in logical order, token by token
    as one micro-batch of every row records them."""
    policy = load_backend("hf").build(load_config(None, ['model.architecture="qwen3_moe"', "training.seed=1"]))
    ids = torch.randint(3, 200, (4, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    routing = policy.routing
    tables = []
    with torch.no_grad():
        for groups in ([[0, 1, 2, 3]], [[2, 3], [0, 1]], [[0], [1], [2], [3]]):
            routing.begin_update()
            for rows in groups:
                with routing.micro_batch(rows, mask[rows]):
                    policy.model(input_ids=ids[rows], attention_mask=mask[rows])
            routing.end_update()
            tables.append(routing.last)
    assert tables[0].row_tokens.tolist() == [7, 5, 7, 2]
    for t in tables[1:]:
        assert torch.equal(t.row_tokens, tables[0].row_tokens)
        for a, b in zip(t.layers, tables[0].layers, strict=True):
            assert torch.equal(a.experts, b.experts) and torch.allclose(a.weights, b.weights)
    assert routing.first is tables[0]


@pytest.mark.slow
def test_a_chosen_step_records_its_routing_and_replays_forced_bitwise(moe_runs: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", str(moe_runs["ws"] / "train.toml"), "--out", str(run), *MOE,
                 "--set", "training.max_steps=2", "--set", "optimizer_batch.capture_steps=[1]"]) == 0
    m = metrics(run, "metrics.json")
    (step,) = m["optimizer_batch/steps"]
    (entry,) = m["routing/steps"]
    assert entry["step"] == 1 and entry["path"] == "routing_step_000001.safetensors"
    table = moe.read_table(run / entry["path"], entry["sha256"])
    assert table.identity["logical_batch_sha256"] == step["logical_batch_sha256"]
    out = tmp_path / "forced"
    assert main(["replay", str(run / step["replay_config"]), "--out", str(out), *MOE,
                 *forced(run / entry["path"], entry["sha256"])]) == 0
    assert metrics(out)["optimizer_batch/final_adapter_sha256"] == step["final_adapter_sha256"]


def test_flips_between_same_condition_repeats_are_reported(moe_runs: dict[str, Any], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """An arm directory's repeats are the routing's own noise: their flips are counted beside the arms'."""
    quiet, noisy = tmp_path / "quiet", tmp_path / "noisy"
    for arm, second in ((quiet, moe_runs["free_again"]), (noisy, moe_runs["flips"])):
        shutil.copytree(moe_runs["free"], arm / "repeat-000")
        shutil.copytree(second, arm / "repeat-001")
    rc, rep = trace_diff(capsys, quiet, moe_runs["flips"])
    assert rc == 1 and rep["routing"]["repeat_pairs"] == 1 and rep["routing"]["repeat_flipped"] == 0
    flips = rep["routing"]["flipped"]
    rc, rep = trace_diff(capsys, noisy, moe_runs["flips"])
    assert rc == 1 and rep["routing"]["repeat_flipped"] == flips > 0  # repeats differ by the perturbed arm's flips
    rc, rep = trace_diff(capsys, moe_runs["free"], moe_runs["flips"])
    assert rc == 1 and rep["routing"]["repeat_pairs"] == 0 and rep["routing"]["repeat_flipped"] is None


def moe_mismatch(moe_runs: dict[str, Any], capsys: pytest.CaptureFixture[str],
                 *extra: str) -> tuple[int, dict[str, Any]]:
    src = moe_runs["source"]
    capsys.readouterr()
    rc = main(["mismatch", str(moe_runs["ws"] / "replay.toml"), *replay_pins(src), *MOE, "--set",
               f'optimizer_batch.replay_path="{src / "optimizer_batch_step_000000.manifest.json"}"', *extra, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_mismatch_attributes_a_gap_to_routing_flips_and_locates_them(moe_runs: dict[str, Any], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The mismatch tool on an MoE capture: every pass records its routing.  Unperturbed, the sampler-side pass routes
    every token as the trainer's pass and nothing is attributed to routing.  With the test-only fault on the trainer
    side (a trainer whose router differs from the sampler's), a handful of tokens flip: both sources' gaps are
    attributed to routing flips (forcing the sampler-side experts on the trainer closes them), the flips are located
    at the layers and tokens where a replay under the same fault flips against the source (an independent record), and
    the response tokens at or after them carry the whole gap of the trainer's own logprobs."""
    rc, doc = moe_mismatch(moe_runs, capsys)
    assert rc == 2 and doc["schema"] == "replayjob.mismatch/v3"
    assert doc["routing"]["passes"]["combined"]["flipped"] == 0 and doc["routing"]["fault"] is None
    sampler = next(s for s in doc["sources"] if s["name"] == "sampler")
    test = next(t for t in sampler["tests"] if t["test"] == "routing")
    assert not test["applicable"] and "no routing flip" in test["reason"]
    assert sampler["routing"]["flipped"] == 0 and sampler["attribution"].startswith("unexplained")

    bound = tmp_path / "bound.toml"
    bound.write_text("max_abs_log_ratio = 1e-5\nmax_kl = 1e-10\nband = 1e-4\nmax_outside_share = 0.0\n")
    monkeypatch.setenv(moe.FAULT_ENV, FLIP_SCALE)
    pin = hashlib.sha256(bound.read_bytes()).hexdigest()
    rc, doc = moe_mismatch(moe_runs, capsys, "--set", f'optimizer_batch.mismatch_bound_sha256="{pin}"', "--bound",
                           str(bound))
    assert rc == 1 and doc["decision"]["status"] == "beyond" and "attributed to routing" in doc["decision"]["reason"]
    assert doc["routing"]["passes"]["routing"]["mode"] == "forced"
    src = {s["name"]: s for s in doc["sources"]}
    for s in src.values():
        assert s["attribution"] == "routing"
        test = next(t for t in s["tests"] if t["test"] == "routing")
        assert test["closes"] and test["explained"] > 0.99
        assert not next(t for t in s["tests"] if t["test"] == "padding")["closes"]  # the layout is not it
    old = src["trainer_old"]
    assert old["routing"]["mass_downstream"] == 1.0 and old["log_ratio"]["abs_max"] > 1e-4
    assert 0 < old["routing"]["response_tokens_downstream"] < old["routing"]["response_tokens"]

    # where: the replay under the same fault flipped exactly these (layer, row, token) against the source's routing
    source = moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"])
    flips = moe.read_table(moe_runs["flips"] / "routing.safetensors", metrics(moe_runs["flips"])["routing"]["sha256"])
    row_of, starts = source.row_of_token(), torch.cumsum(source.row_tokens, 0) - source.row_tokens
    expected = []
    for la, lb in zip(source.layers, flips.layers, strict=True):
        for t in (la.expert_sets() != lb.expert_sets()).any(dim=-1).nonzero().flatten().tolist():
            expected.append((t, la.name, int(row_of[t]), t - int(starts[row_of[t]])))
    located = old["routing"]["flips"]
    assert 0 < len(located) <= 10 and old["routing"]["flipped"] == len(expected)
    assert [(f["layer"], f["row"], f["token"]) for f in located] == [e[1:] for e in sorted(expected)]
    per_layer = {lay["layer"]: lay["flipped"] for lay in old["routing"]["layers"]}
    assert per_layer == {lay.name: sum(e[1] == lay.name for e in expected) for lay in source.layers}
    assert all(sorted(f["experts_trainer"]) != sorted(f["experts_sampler"]) for f in located)


def test_approximate_claim_reports_routing_agreement(moe_runs: dict[str, Any], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """reduce --claim approximate over three traced arms: the same condition, the experts-kernel arm (identical
    routing, numerically different) and the perturbed arm (a handful of flips, nothing upstream).  The verdict's
    routing check says which is which, where the first flip is, and the report says it in words."""
    tol = tmp_path / "tolerances.toml"
    tol.write_text("update_cosine_min = 0.5\nrelative_delta_l2_max = 1.0\n")
    pin = hashlib.sha256(tol.read_bytes()).hexdigest()
    runs = tmp_path / "replays"

    def replay(arm: str, *extra: str) -> None:
        assert main(["replay", str(moe_runs["ws"] / "replay.toml"), "--out", str(runs / arm),
                     *replay_pins(moe_runs["source"]), *MOE, "--set", f'optimizer_batch.arm="{arm}"',
                     "--set", f'optimizer_batch.tolerances_sha256="{pin}"', *extra]) == 0

    replay("base", "--trace")
    replay("kernel", "--trace", "--set", 'model.experts_implementation="batched_mm"',
           "--set", 'optimizer_batch.allow_config_differences=["model.experts_implementation"]')
    monkeypatch.setenv(moe.FAULT_ENV, FLIP_SCALE)
    replay("perturbed", "--trace")
    replay("untraced")  # the same flips, no trace to tell what came first
    monkeypatch.delenv(moe.FAULT_ENV)
    out, report = tmp_path / "verdict.json", tmp_path / "report.md"
    rc = main(["reduce", str(runs), "--claim", "approximate", "--source", str(moe_runs["source"]), "--tolerances",
               str(tol), "--min-repeats", "1", "--out", str(out), "--report", str(report)])
    doc = json.loads(out.read_text())
    check = next(c for c in doc["checks"] if c["name"] == "approximate.routing_agreement")
    assert check["status"] == "pass" and check["group"] == "approximate", (rc, check)
    obs = check["observed"]
    assert obs["reference"] == "base#0" and obs["top_k"] == 2 and len(obs["layers"]) == 2
    arms = obs["arms"]
    assert arms["base"]["flipped"] == 0 and arms["base"]["attribution"] == "identical"
    assert arms["kernel"]["flipped"] == 0 and arms["kernel"]["attribution"] == "identical-routing"
    assert arms["kernel"]["first_forward_divergence"]["name"].endswith("layers.0.mlp")
    p = arms["perturbed"]
    assert 0 < p["flipped"] <= 10 and p["share"] == p["flipped"] / p["tokens"]
    assert p["attribution"] == "downstream-of-flips"
    # the first flip is the one trace-diff finds between a free replay and the perturbed one
    expected = moe.compare(moe.read_table(moe_runs["routing_file"], moe_runs["routing_sha"]),
                           moe.read_table(runs / "perturbed" / "routing.safetensors",
                                          metrics(runs / "perturbed")["routing"]["sha256"]))["first_flip"]
    assert p["first_flip"] == expected
    u = arms["untraced"]
    assert u["attribution"] == "flips-untraced" and u["flipped"] == p["flipped"] and u["first_flip"] == expected
    assert u["first_forward_divergence"] is None
    text = report.read_text()
    assert "## Routing (mixture-of-experts)" in text
    assert f"| perturbed | {p['flipped']} of {p['tokens']} " in text
    assert "differs only downstream of routing flips" in text
    assert "| kernel | 0 of " in text and "differs with identical routing" in text
    # a routing file that is not the bytes its replay pinned is no evidence: the replay's reader refuses it, naming
    # the replay's file and its routing pin, whatever the claim
    data = bytearray((runs / "perturbed" / "routing.safetensors").read_bytes())
    data[-1] ^= 1
    (runs / "perturbed" / "routing.safetensors").write_bytes(bytes(data))
    rc = main(["reduce", str(runs), "--claim", "approximate", "--source", str(moe_runs["source"]), "--tolerances",
               str(tol), "--min-repeats", "1", "--out", str(tmp_path / "refused.json")])
    refusal = json.loads((tmp_path / "refused.json").read_text())["refusal"]
    assert rc == 2 and "pins 'routing.safetensors' at SHA-256" in refusal["message"], refusal
    assert str(runs / "perturbed" / "replay_metrics.json") in refusal["where"]
    data[-1] ^= 1
    (runs / "perturbed" / "routing.safetensors").write_bytes(bytes(data))
    # another replay's routing (here: of another mode), re-pinned in place of the untraced arm's, is not its evidence
    reseal_routing(runs / "untraced", {"mode": "forced"})
    rc = main(["reduce", str(runs), "--claim", "approximate", "--source", str(moe_runs["source"]), "--tolerances",
               str(tol), "--min-repeats", "1", "--out", str(tmp_path / "swapped.json")])
    doc = json.loads((tmp_path / "swapped.json").read_text())
    check = next(c for c in doc["checks"] if c["name"] == "approximate.routing_agreement")
    assert rc == 2 and check["status"] == "refused" and "not this replay's: its mode" in check["detail"], check


@pytest.fixture(scope="module")
def trl_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real GRPOTrainer run of a tiny random-init Qwen3-MoE (saved from a config, nothing fetched; TRL adds the
    model's router loss) with step 0 captured: generations reused (num_iterations = 2), so the capture keeps TRL's
    old logprobs, drawn with step 0's weights."""
    pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
    from conftest import build_base, grpo
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is fetched
    d = tmp_path_factory.mktemp("trl_moe")
    dense = build_base(d / "dense")
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[])
    Qwen3MoeForCausalLM(cfg).save_pretrained(d / "moe")
    AutoTokenizer.from_pretrained(dense).save_pretrained(d / "moe")
    grpo(d / "moe", d / "cap", capture_step=0, lora_dropout=0.0, max_steps=1)
    free, table = trl_replay(d / "cap", d / "free")  # the reference replay: routing free, recorded
    return {"dir": d, "cap": d / "cap", "free": free, "table": table,
            "routing_file": d / "free" / free["routing"]["path"], "routing_sha": free["routing"]["sha256"]}


def trl_replay(cap: Path, out: Path, *extra: str) -> tuple[dict[str, Any], moe.RoutingTable]:
    """A replay of the TRL capture ``cap`` into ``out``: its replay_metrics.json and the routing it pinned."""
    assert main(["replay", str(cap / "replay.toml"), "--out", str(out), *extra]) == 0
    r = metrics(out)
    return r, moe.read_table(out / r["routing"]["path"], r["routing"]["sha256"])


@pytest.mark.slow
def test_a_trl_capture_of_a_moe_model_replays_bitwise_with_routing_observed(trl_moe: dict[str, Any], tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The TRL capture's replay through TRL's own training step is bitwise the source's update and pins the routing
    it observed (every real token of the 8 rows, both routers); under the test-only router fault a replay's routing
    flips tokens against it."""
    cap = trl_moe["cap"]
    source = metrics(cap, "metrics.json")
    r, table = trl_moe["free"], trl_moe["table"]
    assert r["optimizer_batch/final_adapter_sha256"] == source["optimizer_batch/final_adapter_sha256"]
    assert r["loss"] == source["loss"]
    assert table.row_tokens.numel() == 8 and bool((table.row_tokens > 0).all()) and table.mode == "free"
    assert table.top_k == 2 and table.num_experts == 4 and len(table.layers) == 2
    assert table.identity["logical_batch_sha256"] == source["optimizer/logical_batch_sha256"]
    monkeypatch.setenv(moe.FAULT_ENV, "5e-2")
    _, flipped = trl_replay(cap, tmp_path / "perturbed")
    assert flipped.fault == repr(5e-2) and moe.compare(table, flipped)["flipped"] > 0


@pytest.mark.slow
def test_a_trl_replay_forces_a_reference_replays_routing(trl_moe: dict[str, Any], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """model.routing = "forced" in a TRL replay, forcing the routing the free reference replay recorded: the same
    condition is bitwise the free replay and the source's update (the runtime says forced, no token differs from the
    router's own choice); under the test-only router fault the free replay flips tokens and moves the update, while
    the forced one keeps the reference experts, marks exactly the flipped tokens of the first router as forced and
    is bitwise the source's update again."""
    cap, ref = trl_moe["cap"], trl_moe["table"]
    source = metrics(cap, "metrics.json")
    want = source["optimizer_batch/final_adapter_sha256"]
    pin = forced(trl_moe["routing_file"], trl_moe["routing_sha"])
    r, table = trl_replay(cap, tmp_path / "forced", *pin)
    assert r["optimizer_batch/final_adapter_sha256"] == want == trl_moe["free"]["optimizer_batch/final_adapter_sha256"]
    assert r["loss"] == source["loss"] == trl_moe["free"]["loss"]
    assert (r["runtime"]["model.routing"], trl_moe["free"]["runtime"]["model.routing"]) == ("forced", "free")
    assert table.mode == "forced" and moe.compare(ref, table)["identical"]
    assert not any(bool(lay.forced.any()) for lay in table.layers)
    monkeypatch.setenv(moe.FAULT_ENV, "5e-2")
    pr, perturbed = trl_replay(cap, tmp_path / "perturbed")
    fr, held = trl_replay(cap, tmp_path / "perturbed_forced", *pin)
    assert moe.compare(ref, perturbed)["flipped"] > 0 and pr["optimizer_batch/final_adapter_sha256"] != want
    assert fr["optimizer_batch/final_adapter_sha256"] == want and fr["loss"] == source["loss"]
    assert moe.compare(ref, held)["flipped"] == 0 and held.fault == repr(5e-2)
    flipped0 = (ref.layers[0].expert_sets() != perturbed.layers[0].expert_sets()).any(dim=-1)
    assert bool(flipped0.any()) and torch.equal(held.layers[0].forced, flipped0)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "tampered", "fewer tokens", "another model"])
def test_trl_explain_checks_the_forced_routing_file_before_any_model(case: str, trl_moe: dict[str, Any],
                                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A TRL replay's forced routing file that is missing, not the pinned bytes, or of another shape than the captured
    rows' real tokens or the base model's routers (its config.json) is refused by explain (exit 2, the reason, no
    traceback) with no model built."""
    import transformers

    def no_model(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a model was built")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    cfg = str(trl_moe["cap"] / "replay.toml")
    t, sha = trl_moe["table"], trl_moe["routing_sha"]
    capsys.readouterr()
    assert main(["explain", cfg, *forced(trl_moe["routing_file"], sha)]) == 0
    path = tmp_path / "routing.safetensors"
    sha = hostile_routing_file(case, t, trl_moe["routing_file"], sha, path)
    capsys.readouterr()
    rc = main(["explain", cfg, *forced(path, sha)])
    err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err.err
    text = err.out + err.err
    assert {"missing": "no routing file here", "tampered": "SHA-256",
            "fewer tokens": f"holds 8 rows of {t.tokens - 1} tokens that are not",
            "another model": "routes 3 layers top-2 of 4 experts; this model has 2 MoE layers"}[case] in text


@pytest.mark.slow
def test_trl_mismatch_attributes_routing_flips(trl_moe: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """mismatch on the TRL MoE capture: TRL's old logprobs equal the recompute bitwise and nothing flips; with the
    test-only fault on the trainer side a handful of tokens flip, the gap is attributed to routing (TRL's function
    with the sampler-side experts forced closes it) and the response tokens downstream of the flips carry it (the
    rest is the rounding of tokens that shared an expert with a flipped one)."""
    def run() -> dict[str, Any]:
        capsys.readouterr()
        assert main(["mismatch", str(trl_moe["cap"] / "replay.toml"), "--json"]) == 2  # no bound declared
        doc: dict[str, Any] = json.loads(capsys.readouterr().out)
        return doc

    doc = run()
    (old,) = doc["sources"]
    assert old["name"] == "trainer_old" and old["policy_lag"]["steps"] == 0
    assert old["log_ratio"]["bitwise_equal_share"] == 1.0 and doc["routing"]["passes"] == {}
    monkeypatch.setenv(moe.FAULT_ENV, "3e-3")
    doc = run()
    (old,) = doc["sources"]
    assert old["attribution"] == "routing" and old["log_ratio"]["abs_max"] > 1e-4
    assert doc["routing"]["passes"]["padding"]["flipped"] == 0  # trainer side: routed as the trainer pass
    assert doc["routing"]["passes"]["routing"]["mode"] == "forced"
    r = old["routing"]
    assert 0 < r["flipped"] <= 10 and r["mass_downstream"] > 0.99 and r["flips"]
    f = r["flips"][0]
    assert sorted(f["experts_trainer"]) != sorted(f["experts_sampler"]) and f["margin_trainer"] < 2 * 3e-3


def test_the_routers_a_config_builds_are_counted_as_transformers_builds_them() -> None:
    """config_routers (the forced file's shape check of a base model directory) against the models transformers
    builds from each config: MoE layers, top-k and experts, whichever key the expert count is saved under."""
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2Config, Qwen3MoeConfig

    small = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=16)
    configs = [Qwen3MoeConfig(**small, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, head_dim=4,
                              moe_intermediate_size=8, decoder_sparse_step=2, mlp_only_layers=[3]),
               MixtralConfig(**small, num_hidden_layers=2, num_local_experts=3, num_experts_per_tok=2, head_dim=4),
               OlmoeConfig(**small, num_hidden_layers=2, num_experts=5, num_experts_per_tok=3)]
    for c in configs:
        found = moe.routers(AutoModelForCausalLM.from_config(c))
        want = (len(found), int(found[0][1].top_k), int(found[0][1].num_experts))
        assert moe.config_routers(json.loads(c.to_json_string())) == want, type(c).__name__
    assert moe.config_routers(configs[0].to_dict())[0] == 1  # layer 1 only: layer 3 is dense by mlp_only_layers
    assert moe.config_routers(json.loads(Qwen2Config(**small, num_hidden_layers=2).to_json_string())) is None


@pytest.mark.slow
def test_a_trl_capture_records_its_source_steps_routing(trl_moe: dict[str, Any], tmp_path: Path) -> None:
    """The TRL capture writes the routing its own step used (routing_step_000000.safetensors, pinned in the manifest's
    framework_state.routing and recorded on the step's logical batch): the free replay routed exactly as the source
    (experts, weights and margins bitwise), and a replay forcing the source's routing is bitwise the source's update."""
    cap = trl_moe["cap"]
    source = metrics(cap, "metrics.json")
    manifest = json.loads((cap / source["optimizer_batch/manifest_path"]).read_text())
    pin = manifest["framework_state"]["routing"]
    assert pin["path"] == moe.source_step_file(0)
    table = moe.read_table(cap / pin["path"], pin["sha256"])
    assert table.identity == {"logical_batch_sha256": source["optimizer/logical_batch_sha256"]} and table.fault is None
    ref = trl_moe["table"]
    assert torch.equal(table.row_tokens, ref.row_tokens) and moe.compare(table, ref)["identical"]
    assert all(torch.equal(a.margin, b.margin) and torch.equal(a.weights, b.weights)
               for a, b in zip(table.layers, ref.layers, strict=True))
    r, held = trl_replay(cap, tmp_path / "forced_source", *forced(cap / pin["path"], pin["sha256"]))
    assert r["optimizer_batch/final_adapter_sha256"] == source["optimizer_batch/final_adapter_sha256"]
    assert r["runtime"]["model.routing"] == "forced" and moe.compare(table, held)["identical"]
