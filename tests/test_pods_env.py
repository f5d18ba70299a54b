"""`[pods].env` refuses, beside replayjob's own and the determinism variables, every family of variables that
changes what a replay runs or measures (the dynamic loader's, Python's, PyTorch's, cuDNN's, Triton's, the CPU
math libraries', XLA's), each with its reason, and a value holding a NUL byte; what the families leave alone
(a proxy, a token's path) is set as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayjob.artifacts import pods
from replayjob.artifacts.spec import spec_from_text
from replayjob.errors import ConfigError
from replayjob.launch import k8s

SPEC = Path(__file__).resolve().parents[1] / "examples" / "ablation.toml"

# (variable, words of its family's reason): every family, by the variables that made it one
FAMILIES = [
    ("LD_PRELOAD", "dynamic loader's variables (LD_*): they load other libraries"),
    ("LD_LIBRARY_PATH", "another cuBLAS"),
    ("LD_AUDIT", "dynamic loader's variables (LD_*)"),
    ("PYTHONPATH", "Python's variables (PYTHON*): they change what the interpreter imports and runs"),
    ("PYTHONSTARTUP", "Python's variables (PYTHON*)"),
    ("PYTHONOPTIMIZE", "drops assertions"),
    ("PYTHONWARNINGS", "turns warnings into errors"),
    ("PYTHONMALLOC", "Python's variables (PYTHON*)"),
    ("PYTHON_GIL", "Python's variables (PYTHON*)"),
    ("PYTORCH_CUDA_ALLOC_CONF", "PyTorch's runtime variables (PYTORCH_*): they change the CUDA caching allocator"),
    ("PYTORCH_NO_CUDA_MEMORY_CACHING", "the peak memory and the time a replay measures"),
    ("CUDNN_LOGINFO_DBG", "cuDNN's variables (CUDNN_*): they change which cuDNN kernels run"),
    ("TRITON_PRINT_AUTOTUNING", "Triton's variables (TRITON_*): they change how Triton compiles, autotunes"),
    ("TRITON_INTERPRET", "Triton's variables (TRITON_*)"),
    ("MKL_CBWR", "MKL's variables (MKL_*): they change MKL's code path and threads"),
    ("MKL_ENABLE_INSTRUCTIONS", "MKL's variables (MKL_*)"),
    ("OMP_PROC_BIND", "OpenMP's variables (OMP_*): they change the OpenMP threads"),
    ("OMP_SCHEDULE", "OpenMP's variables (OMP_*)"),
    ("KMP_AFFINITY", "Intel OpenMP's variables (KMP_*)"),
    ("KMP_BLOCKTIME", "Intel OpenMP's variables (KMP_*)"),
    ("OPENBLAS_NUM_THREADS", "OpenBLAS's variables (OPENBLAS_*): they change OpenBLAS's threads and the kernels"),
    ("OPENBLAS_CORETYPE", "OpenBLAS's variables (OPENBLAS_*)"),
    ("GOMP_CPU_AFFINITY", "GNU OpenMP's variables (GOMP_*)"),
    ("GOMP_SPINCOUNT", "GNU OpenMP's variables (GOMP_*)"),
    ("XLA_FLAGS", "XLA's variables (XLA_*): they change how XLA compiles and runs its graphs"),
    ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA's variables (XLA_*)"),
]


def with_pods(table: str) -> str:
    return SPEC.read_text(encoding="utf-8") + "\n" + table + "\n"


@pytest.mark.parametrize("part", ["all", "gpu", "cpu"])
@pytest.mark.parametrize(("name", "said"), FAMILIES)
def test_a_variable_that_changes_what_a_replay_runs_or_measures_is_refused_with_its_family_s_reason(
        name: str, said: str, part: str) -> None:
    with pytest.raises(ConfigError) as err:
        spec_from_text(with_pods(f'[pods.{part}]\nenv = {{"{name}" = "1"}}'), "spec")
    exc = err.value
    assert exc.where == f"spec: pods.{part}.env", exc.where
    assert exc.message.startswith(f"{name} is one of "), exc.message
    assert said in exc.message, exc.message
    assert exc.hint is not None and "image" in exc.hint
    assert "\n" not in exc.message


@pytest.mark.parametrize(("prefix", "family", "why"), pods.ENV_FAMILIES)
def test_every_family_says_why_and_is_documented(prefix: str, family: str, why: str) -> None:
    assert prefix.isupper() and family and why.startswith(("they change", "they load"))
    assert f"`{prefix}*`" in pods.FIELD_DOCS["env"][1]
    assert pods.env_family(prefix + "X") == (prefix, family, why)
    with pytest.raises(ConfigError, match=f"is one of {family}"):
        pods.read_pods({"all": {"env": {prefix + "X": "1"}}})


def test_replayjob_s_own_variables_keep_their_own_reason() -> None:
    """A variable that is replayjob's own and of a family (OMP_NUM_THREADS, PYTHONHASHSEED, TRITON_CACHE_DIR) is
    refused as replayjob's own: the determinism environment is what it is about."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                 "TRITON_CACHE_DIR"):
        with pytest.raises(ConfigError, match=f"{name} is replayjob's own variable"):
            pods.read_pods({"gpu": {"env": {name: "1"}}})


@pytest.mark.parametrize("value", ["\u0000", "a\u0000b", "proxy\u0000"])
def test_a_value_holding_a_nul_byte_is_refused(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        pods.read_pods({"cpu": {"env": {"HTTPS_PROXY": value}}})
    assert err.value.where == "pods.cpu.env"
    assert "the value of HTTPS_PROXY holds a NUL byte" in err.value.message
    with pytest.raises(ConfigError, match="NUL byte"):  # the same through a spec file (TOML's \u0000)
        spec_from_text(with_pods('[pods.all]\nenv = {"HTTPS_PROXY" = "a\\u0000b"}'), "spec")


@pytest.mark.parametrize("name", ["HTTPS_PROXY", "NO_PROXY", "HF_TOKEN_PATH", "LDAP_URI", "OMPI_MCA_btl",
                                  "MY_PYTHON_APP", "WANDB_MODE", "AWS_REGION"])
def test_what_no_family_covers_is_set_as_before(name: str) -> None:
    spec = spec_from_text(with_pods(f'[pods.gpu]\nenv = {{"{name}" = "v\\nw"}}'), "spec")
    jobs = k8s.stage_jobs(spec, "r1")
    (cont,) = jobs["capture.yaml"]["spec"]["template"]["spec"]["containers"]
    assert {"name": name, "value": "v\nw"} in cont["env"]
