"""``replayjob mismatch``: the sampler's recorded view against the trainer's recompute, attributed and gated.

Captures of the tiny default model on CPU: at temperature 1 the sampler's logprobs are within a tight
declared bound; the reference trainer as it was before ``algorithm.logprob_temperature`` (no
temperature in its logprobs) sampling at 1.2 is beyond it and attributed to the temperature, the
trainer as it is now is within it; a top-p sampler and a bfloat16 sampler are attributed by name; a
sampler that attends its left padding is attributed to the padding.  A TRL capture with
``num_iterations = 2`` names its source and the policy lag.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import replay_pins

from replayjob.artifacts import capture_payload as payload
from replayjob.cli import main
from replayjob.digest import sha256_file
from replayjob.mismatch import stats
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.logprobs import logprobs_of, truncate
from replayjob.runtime.distributed import observe

TIGHT = "max_abs_log_ratio = 1e-5\nmax_kl = 1e-10\nband = 1e-4\nmax_outside_share = 0.0\n"
LOGPROB_NONE = 'algorithm.logprob_temperature="none"'


@pytest.fixture(scope="module")
def bound(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    p = tmp_path_factory.mktemp("bound") / "bound.toml"
    p.write_text(TIGHT)
    return p, sha256_file(p)


@pytest.fixture(scope="module")
def captures(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[str]]]:
    """One capture per sampler condition (name -> (directory, the --set values it ran with))."""
    conditions = {"t12_untempered": ["inference.temperature=1.2", LOGPROB_NONE],
                  "t12": ["inference.temperature=1.2"],
                  "top_p": ["inference.top_p=0.9"],
                  "bf16": ['inference.sampling_dtype="bfloat16"']}
    root = tmp_path_factory.mktemp("mismatch_captures")
    out = {}
    for name, sets in conditions.items():
        d = root / name
        assert main(["capture", str(workspace / "source.toml"), "--out", str(d),
                     *[a for s in sets for a in ("--set", s)]]) == 0
        out[name] = (d, sets)
    return out


def mismatch(workspace: Path, capture: Path, sets: list[str], *extra: str) -> list[str]:
    manifest = capture / "optimizer_batch_step_000000.manifest.json"
    return ["mismatch", str(workspace / "replay.toml"), *replay_pins(capture),
            "--set", f'optimizer_batch.replay_path="{manifest}"', *[a for s in sets for a in ("--set", s)], *extra]


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    code = main([*argv, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in doc["sources"]}


def test_temperature_one_is_within_a_tight_bound(workspace: Path, capture_dir: Path, bound: tuple[Path, str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path, sha = bound
    code, doc, err = run_json(mismatch(workspace, capture_dir, [f'optimizer_batch.mismatch_bound_sha256="{sha}"'],
                                       "--bound", str(path)), capsys)
    assert code == 0, err
    src = by_name(doc)
    assert sorted(src) == ["sampler", "trainer_old"] and doc["tokens"] == 128
    sampler = src["sampler"]
    assert sampler["policy_lag"]["steps"] == 0 and sampler["bound"]["within"] is True
    assert 0 < sampler["log_ratio"]["abs_max"] < 1e-5 and sampler["log_ratio"]["k3"] < 1e-12
    assert src["trainer_old"]["log_ratio"]["bitwise_equal_share"] == 1.0  # the trainer's own function, same step
    assert src["trainer_old"]["attribution"].startswith("none")
    assert doc["decision"]["status"] == "within" and doc["bound"]["sha256"] == sha
    assert [p["positions"][0] for p in sampler["profile"]] == list(range(8))  # one entry per response position


def test_no_bound_reports_then_refuses_a_decision(workspace: Path, capture_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(mismatch(workspace, capture_dir, [])) == 2
    out = capsys.readouterr()
    assert "source sampler (sampler_logprobs)" in out.out and "KL estimates: k1" in out.out
    assert "no bound declared" in out.err and "Traceback" not in out.err


@pytest.mark.parametrize("case", ["unpinned", "wrong pin", "unknown key"])
def test_bound_must_be_declared_and_pinned(case: str, workspace: Path, capture_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bound.toml"
    path.write_text(TIGHT + ("extra = 1\n" if case == "unknown key" else ""))
    pin = {"unpinned": [], "wrong pin": ['optimizer_batch.mismatch_bound_sha256="' + "0" * 64 + '"'],
           "unknown key": [f'optimizer_batch.mismatch_bound_sha256="{sha256_file(path)}"']}[case]
    assert main(mismatch(workspace, capture_dir, pin, "--bound", str(path))) == 2
    err = capsys.readouterr()
    assert err.out == ""  # refused before anything is recomputed
    assert {"unpinned": "not pinned", "wrong pin": "hashes to", "unknown key": "unknown field `extra`"}[case] in err.err


def test_a_capture_directory_names_its_one_replay_config(capture_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from replayjob.mismatch import resolve_capture

    assert main(["mismatch", str(capture_dir)]) == 2  # a step-zero capture: its replay config is the workspace's
    assert "no replay config(s) in the capture directory" in capsys.readouterr().err
    (tmp_path / "replay_step_000003.toml").write_text("")
    assert resolve_capture(tmp_path) == tmp_path / "replay_step_000003.toml"
    (tmp_path / "replay_step_000004.toml").write_text("")
    with pytest.raises(Exception, match="2 replay config"):
        resolve_capture(tmp_path)


def test_untempered_trainer_at_temperature_12_is_attributed_to_the_temperature_and_fixed(
        workspace: Path, captures: dict[str, tuple[Path, list[str]]], bound: tuple[Path, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    path, sha = bound
    pin = f'optimizer_batch.mismatch_bound_sha256="{sha}"'
    d, sets = captures["t12_untempered"]
    code, doc, err = run_json(mismatch(workspace, d, [*sets, pin], "--bound", str(path)), capsys)
    assert code == 1 and "attributed to temperature" in err
    sampler = by_name(doc)["sampler"]
    assert sampler["attribution"] == "temperature" and sampler["bound"]["within"] is False
    assert doc["trainer"]["temperature"] == 1.0 and doc["sampler"]["temperature"] == 1.2
    test = next(t for t in sampler["tests"] if t["test"] == "temperature")
    assert test["closes"] and test["explained"] > 0.99 and "divided by 1.2" in test["hypothesis"]
    assert any("best-fitting temperature (least squares over [0.25, 4]): 1.2" in e for e in test["evidence"])
    assert sampler["log_ratio"]["abs_max"] > 0.01
    d, sets = captures["t12"]  # the trainer now applies the sampling temperature: within the same bound
    code, doc, err = run_json(mismatch(workspace, d, [*sets, pin], "--bound", str(path)), capsys)
    assert code == 0, err
    assert doc["trainer"]["temperature"] == 1.2 and by_name(doc)["sampler"]["log_ratio"]["abs_max"] < 1e-5


@pytest.mark.parametrize(("name", "attribution"), [("top_p", "truncation"), ("bf16", "precision")])
def test_truncating_and_bfloat16_samplers_are_attributed_by_name(
        name: str, attribution: str, workspace: Path, captures: dict[str, tuple[Path, list[str]]],
        bound: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    path, sha = bound
    d, sets = captures[name]
    code, doc, err = run_json(mismatch(workspace, d, [*sets, f'optimizer_batch.mismatch_bound_sha256="{sha}"'],
                                       "--bound", str(path)), capsys)
    assert code == 1 and f"attributed to {attribution}" in err
    sampler = by_name(doc)["sampler"]
    assert sampler["attribution"] == attribution
    test = next(t for t in sampler["tests"] if t["test"] == attribution)
    assert test["closes"] and test["explained"] > 0.99
    assert by_name(doc)["trainer_old"]["log_ratio"]["bitwise_equal_share"] == 1.0


def test_a_sampler_attending_its_left_padding_is_attributed_to_the_padding(
        workspace: Path, tmp_path: Path) -> None:
    """Library level: the recorded values of a capture with ragged prompts are replaced by those of a sampler
    whose attention covered its left padding (recomputed in the sampler's layout with an all-ones mask)."""
    from replayjob.config import from_dict, load_config
    from replayjob.mismatch import builtin, report
    from replayjob.producers.builtin.admission import admit, source_config

    sets = ['environment.task="reverse"']
    d = tmp_path / "rev"
    assert main(["capture", str(workspace / "source.toml"), "--out", str(d), "--set", sets[0]]) == 0
    argv = mismatch(workspace, d, sets)[2:]
    cfg = load_config(workspace / "replay.toml", [v for i, v in enumerate(argv) if i % 2])
    adm = admit(observe(cfg, running=False))  # resolved as an entry point resolves it
    adm.raise_if_refused()
    assert adm.manifest is not None and adm.batch is not None
    policy = builtin.build_policy(cfg, adm)
    planted = []
    with torch.no_grad():
        policy.model.eval()
        for _, ids, att, pos, mask in builtin._sampler_layout(adm.batch, 4, policy.tokenizer.pad_id):
            logits = builtin._forward(policy.model, ids, torch.ones_like(att), pos)
            planted.append(logprobs_of(logits, ids[:, 1:], 1.0)[mask].double())
    batch = dataclasses.replace(adm.batch, sampler_logprobs=torch.cat(planted))
    views = builtin.recompute(policy, batch, from_dict(source_config(adm.manifest)))
    rep = report.build({"framework": "replayjob", "step": 0, "manifest": "m"}, views, None, False, 0.0)
    sampler = next(s for s in rep.sources if s.source.name == "sampler")
    assert sampler.attribution.attribution == "padding"
    groups = {g["offset"]: g["abs_mean"] for g in sampler.by_pad_offset["groups"]}
    assert groups[0] == 0.0 and min(v for k, v in groups.items() if k) > 1e-3  # unpadded rows carry no gap
    assert rep.decision["status"] == "no bound declared"


def test_trl_num_iterations_2_names_its_source_and_the_policy_lag(trl_capture: dict[str, Any], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  fresh_determinism_mode: None) -> None:
    config = trl_capture["dir"] / "replay.toml"
    code, doc, err = run_json(["mismatch", str(config)], capsys)
    assert code == 2 and "no bound declared" in err and "predate step K by 1 step(s)" in err
    assert doc["capture"]["framework"] == "trl" and doc["capture"]["step"] == 1
    (old,) = doc["sources"]  # no vLLM: TRL keeps no sampler logprobs, only its own old ones
    assert old["name"] == "trainer_old" and old["field"] == "old_per_token_logps"
    assert old["policy_lag"]["steps"] == 1 and "recorded by the capture" in old["policy_lag"]["reason"]
    assert old["attribution"] == "not attributed: policy lag of 1 step(s)"
    assert old["log_ratio"]["abs_max"] > 0  # the update of step 0 lies between
    bound = tmp_path / "bound.toml"
    bound.write_text(TIGHT)
    pin = ["--set", f'optimizer_batch.mismatch_bound_sha256="{sha256_file(bound)}"', "--bound", str(bound)]
    assert main(["mismatch", str(config), *pin]) == 2  # refused across the lag
    assert "policy lag" in capsys.readouterr().err
    code, doc, _ = run_json(["mismatch", str(config), *pin, "--allow-lag"], capsys)
    assert code == 1 and doc["decision"]["status"] == "beyond"
    assert "across a policy lag of 1 step(s)" in doc["sources"][0]["attribution"]


def test_payload_without_sampler_logprobs_reads_as_no_sampler_source() -> None:
    from replayjob.mismatch import builtin

    m = torch.ones((2, 3), dtype=torch.float64)
    fields = {k: m * (i + 1) * (-1 if k.endswith("logprobs") else 1) for i, k in enumerate(payload.FLOAT_FIELDS)}
    seqs, prompts = [[1, 2, 3, 4], [5, 6, 7, 8]], [1, 1]
    old = OptimizerBatch.from_padded(seqs, prompts, fields, m)
    new = OptimizerBatch.from_padded(seqs, prompts, {**fields, "sampler_logprobs": -m}, m)
    rng = {"cpu": torch.get_rng_state()}
    assert old.sampler_logprobs is None and new.digests() == old.digests()  # not in the row digests
    back, _ = payload.decode(payload.encode(old, rng))
    assert back.sampler_logprobs is None
    back, _ = payload.decode(payload.encode(new, rng))
    assert back.sampler_logprobs is not None and back.sampler_logprobs.tolist() == [-1.0] * 6
    side = builtin.Side(temperature=1.0)
    assert [s.name for s in builtin.sources(old, side, side)] == ["trainer_old"]
    assert [s.name for s in builtin.sources(back, side, side)] == ["sampler", "trainer_old"]
    short = dataclasses.replace(new, sampler_logprobs=new.sampler_logprobs[:-1])  # type: ignore[index]
    with pytest.raises(Exception, match="resp_offsets end at 6 but sampler_logprobs has 5 values"):
        payload.decode(payload.encode(short, rng))


def test_old_capture_configs_read_as_what_they_ran() -> None:
    """A capture written before these settings existed sampled untruncated in the model's dtype, and its
    trainer applied no temperature (which at temperature 1 is the same computation)."""
    from replayjob.producers.builtin.admission import source_config

    class M:
        def __init__(self, t: float):
            self.config = {"inference": {"engine": "pytorch", "max_new_tokens": 8, "temperature": t},
                           "algorithm": {"estimator": "grpo"}, "distributed": {}}

    for t, want in ((1.0, "sampling"), (1.2, "none")):
        c = source_config(M(t))  # type: ignore[arg-type]
        assert c["algorithm"]["logprob_temperature"] == want
        assert (c["inference"]["top_p"], c["inference"]["top_k"], c["inference"]["sampling_dtype"]) == (1.0, 0, "model")


def test_logprobs_at_temperature_one_are_unchanged_and_truncation_renormalises() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn((3, 5, 11), generator=g)
    y = torch.randint(0, 11, (3, 5), generator=g)
    plain = torch.log_softmax(z, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(logprobs_of(z, y, 1.0), plain)
    assert torch.equal(truncate(z, 0, 1.0), z)
    kept = truncate(z, 3, 0.5)
    assert bool(((~kept.isinf()).sum(-1) <= 3).all()) and bool((~kept.isinf()).any(-1).all())
    assert torch.allclose(torch.softmax(kept, dim=-1).sum(-1), torch.ones(3, 5))


def test_figures_of_known_log_ratios() -> None:
    lr = torch.tensor([0.0, 0.2, -0.2, 0.0], dtype=torch.float64)
    s = stats.summary(lr, bands=(0.1,))
    rho = torch.exp(lr)
    assert s["k1"] == pytest.approx(0.0) and s["k3"] == pytest.approx(float((rho - 1 - lr).mean()))
    assert s["outside"]["0.1"] == 0.5 and s["bitwise_equal_share"] == 0.5 and s["abs_max"] == pytest.approx(0.2)
    worst = stats.worst_sequences(lr, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]))
    assert [w["row"] for w in worst] == [0, 1] and worst[0]["at_position"] == 1


@pytest.mark.parametrize(("line", "rule"), [
    ("max_kl = 18446744073709551617", "outside the signed 64-bit range"),
    ("max_kl = -1", "field `max_kl`: expected `float` >= 0.0"),
    ("max_kl = nan", "field `max_kl`"),
    ("max_kl = inf", "field `max_kl`"),
    ("max_kl = true", "expected `float`, got `bool`"),
    ('max_kl = "1e-8"', "expected `float`, got `str`"),
])
def test_the_bound_file_is_read_through_its_declaration(line: str, rule: str, tmp_path: Path) -> None:
    """Every value is a finite number in its range; an integer wider than 64 bits is refused by the TOML reader."""
    from replayjob.artifacts.mismatch_bound import read_bound
    from replayjob.errors import IntegrityError
    path = tmp_path / "bound.toml"
    path.write_text(TIGHT.replace("max_kl = 1e-10", line))
    with pytest.raises(IntegrityError) as info:
        read_bound(path, sha256_file(path))
    assert rule in info.value.message and str(path) in info.value.diagnostics()
    path.write_text(TIGHT)
    assert read_bound(path, sha256_file(path)).max_kl == 1e-10


@pytest.mark.parametrize("share", ["one", "half", "all"])
def test_non_finite_logprobs_are_never_within_a_bound(share: str, tmp_path: Path) -> None:
    """The finite tokens agree exactly; NaN and infinite sampler logprobs are counted, located and decide
    "beyond" (exit 1): they were once left out, and a source half or wholly NaN was decided within."""
    from replayjob.artifacts.mismatch_bound import read_bound
    from replayjob.mismatch.report import decide, source_report
    from replayjob.mismatch.views import Side, Source, Views
    n = 8
    trainer = -torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values = trainer.clone()
    bad = {"one": [5], "half": [0, 2, 4, 6], "all": list(range(n))}[share]
    for k, i in enumerate(bad):
        values[i] = (math.nan, math.inf, -math.inf)[k % 3]
    side = Side(temperature=1.0)
    src = Source("sampler", "sampler_logprobs", "the sampler", side, 0, "same step", values)
    views = Views(row=torch.arange(n) // 4, position=torch.arange(n) % 4, token=torch.arange(n) + 10,
                  pad_offset=torch.zeros(n, dtype=torch.int64), trainer=trainer, trainer_side=side,
                  sampler_side=side, sources=[src])
    path = tmp_path / "bound.toml"
    path.write_text(TIGHT)
    rep = source_report(views, src, read_bound(path, sha256_file(path)), allow_lag=False)
    assert rep.nonfinite_tokens == len(bad) and rep.summary["tokens"] == n - len(bad)
    assert [(w["row"], w["position"]) for w in rep.nonfinite_at] == [(i // 4, i % 4) for i in bad]
    assert rep.nonfinite_at[0]["source"] in ("NaN", "Infinity", "-Infinity")
    assert rep.bound is not None and rep.bound["checks"]["nonfinite_tokens"] == {"value": len(bad), "limit": 0,
                                                                                 "ok": False}
    decision = decide([rep], None, False)
    assert decision["exit_code"] == 2  # no bound: nothing decided
    rep_json = json.dumps(rep.to_json(), allow_nan=False)  # strict JSON: non-finite values as strings
    assert '"nonfinite"' in rep_json
    decision = decide([rep], read_bound(path, sha256_file(path)), False)
    assert decision["status"] == "beyond" and decision["exit_code"] == 1 and "nonfinite_tokens" in decision["reason"]


def _trl_micro_batch(c: int = 4, **over: Any) -> Any:
    from types import SimpleNamespace
    inputs = {"prompt_ids": torch.ones((2, 3), dtype=torch.int64), "prompt_mask": torch.ones((2, 3), dtype=torch.int64),
              "completion_ids": torch.ones((2, c), dtype=torch.int64),
              "completion_mask": torch.ones((2, c), dtype=torch.int64),
              "sampling_per_token_logps": -torch.rand((2, c), dtype=torch.float32)}
    inputs.update(over)
    return SimpleNamespace(inputs=inputs, input_values={})


@pytest.mark.parametrize(("over", "message"), [
    ({"sampling_per_token_logps": -torch.rand((2, 3))}, "sampling_per_token_logps has shape [2, 3], its "
                                                         "completion_mask [2, 4]"),
    ({"old_per_token_logps": -torch.rand((2, 5))}, "old_per_token_logps has shape [2, 5]"),
    ({"completion_ids": torch.ones((2, 5), dtype=torch.int64)}, "completion_ids has shape [2, 5]"),
    ({"prompt_mask": torch.ones((3, 3), dtype=torch.int64)}, "prompt_mask has shape [3, 3], not one row per row"),
    ({"completion_mask": torch.ones(8, dtype=torch.int64)}, "completion_mask has shape [8], not [rows, tokens]"),
])
def test_a_logprob_source_misaligned_with_its_tokens_is_refused(over: dict[str, Any], message: str) -> None:
    """A captured source whose shape is not its mask's put its values at other tokens (or failed on the mask with
    an IndexError, exit 3): refused naming the micro-batch and the tensor, before any model is used."""
    from types import SimpleNamespace

    from replayjob.errors import IntegrityError
    from replayjob.mismatch import trl
    good = _trl_micro_batch()
    if "old_per_token_logps" in over:
        good.inputs["old_per_token_logps"] = -torch.rand((2, 4))
    bad = _trl_micro_batch(**over)
    session = SimpleNamespace(trainer=None, model=None, device="cpu")
    with pytest.raises(IntegrityError, match=re.escape(f"captured micro-batch 1: {message}")):
        trl.recompute(session, [good, bad], {"trl": {}}, {}, 0)


def test_a_verl_logprob_source_misaligned_with_its_response_is_refused() -> None:
    from types import SimpleNamespace

    from replayjob.errors import IntegrityError
    from replayjob.mismatch import verl
    inputs = {"responses": torch.ones((2, 4), dtype=torch.int64), "response_mask": torch.ones((2, 4)),
              "prompts": torch.ones((2, 3), dtype=torch.int64), "rollout_log_probs": -torch.rand((2, 3))}
    session = SimpleNamespace(observed={}, engine_values={})
    with pytest.raises(IntegrityError, match=re.escape("captured micro-batch 0: rollout_log_probs has shape [2, 3], "
                                                       "its response_mask [2, 4]")):
        verl.recompute(session, [SimpleNamespace(inputs=inputs, input_values={})], {}, 0)


def test_a_source_of_another_length_than_the_response_tokens_is_refused() -> None:
    """Whatever the producer: a source holds one value per response token (a built-in capture's too)."""
    from replayjob.errors import IntegrityError
    from replayjob.mismatch.views import Collector, Side, Source
    side = Side(temperature=1.0)
    src = Source("sampler", "sampler_logprobs", "the sampler", side, 0, "same step",
                 -torch.rand(7, dtype=torch.float64))
    n = 8
    with pytest.raises(IntegrityError, match=r"the sampler source \(sampler_logprobs\) holds \[7\] values for 8"):
        Collector(torch.arange(n) // 4, torch.arange(n) % 4, torch.arange(n), torch.zeros(n, dtype=torch.int64),
                  side, side, [src])


def test_a_capture_of_no_response_token_is_refused_not_within(tmp_path: Path) -> None:
    """Every response mask row zero: no token, every figure 0, and the decision was "within" (exit 0) on nothing."""
    from replayjob.artifacts.mismatch_bound import read_bound
    from replayjob.mismatch.report import decide, source_report
    from replayjob.mismatch.views import Side, Source, Views
    side = Side(temperature=1.0)
    none = torch.zeros(0, dtype=torch.int64)
    src = Source("sampler", "sampler_logprobs", "the sampler", side, 0, "same step",
                 torch.zeros(0, dtype=torch.float64))
    views = Views(row=none, position=none, token=none, pad_offset=none, trainer=torch.zeros(0, dtype=torch.float64),
                  trainer_side=side, sampler_side=side, sources=[src])
    path = tmp_path / "bound.toml"
    path.write_text(TIGHT)
    bound = read_bound(path, sha256_file(path))
    rep = source_report(views, src, bound, allow_lag=False)
    decision = decide([rep], bound, False)
    assert decision["status"] == "refused" and decision["exit_code"] == 2
    assert "no response token" in decision["reason"]


def test_a_figure_beyond_a_float_is_written_as_strict_json_and_decides_beyond(tmp_path: Path) -> None:
    """A recorded logprob of -800 (finite, <= 0: within its field's domain) against a trainer's -0.5: the ratio
    exp(799.5) overflows, so k3 is infinite, and the sum of log-ratios of eight such tokens overflows too.  The
    text report was printed (exit 1), but ``--json`` failed to write the report ("Out of range float values"),
    refusing (exit 2) a capture it had decided; the figures are now written as the strict JSON strings the other
    reports use ("Infinity"), and the decision is the same either way."""
    from replayjob.artifacts.mismatch_bound import read_bound
    from replayjob.jsonio import pretty_bytes
    from replayjob.mismatch.report import build
    from replayjob.mismatch.views import Side, Source, Views
    n = 8
    trainer = torch.full((n,), -0.5, dtype=torch.float64)
    path = tmp_path / "bound.toml"
    path.write_text(TIGHT)
    bound = read_bound(path, sha256_file(path))
    for values in (torch.tensor([-0.5] * 3 + [-800.0] + [-0.5] * 4, dtype=torch.float64),
                   torch.full((n,), -1e308, dtype=torch.float64)):
        side = Side(temperature=1.0)
        src = Source("sampler", "sampler_logprobs", "the sampler", side, 0, "same step", values)
        views = Views(row=torch.arange(n) // 4, position=torch.arange(n) % 4, token=torch.arange(n) + 10,
                      pad_offset=torch.zeros(n, dtype=torch.int64), trainer=trainer, trainer_side=side,
                      sampler_side=side, sources=[src])
        rep = build({"config": "c", "manifest": "m", "manifest_sha256": "0" * 64, "framework": "replayjob",
                     "step": 0}, views, bound, False, 0.0)
        doc = json.loads(pretty_bytes(rep.to_json()))
        assert doc["sources"][0]["log_ratio"]["k3"] == "Infinity", doc["sources"][0]["log_ratio"]
        assert doc["decision"]["status"] == "beyond" and doc["decision"]["exit_code"] == 1
        assert "kl_k3 inf > 1e-10" in doc["decision"]["reason"] and "k3 inf" in rep.render()
