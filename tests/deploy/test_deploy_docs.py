"""docs/deploy.md (deploying to Kubernetes; the README only links to it) agrees with the manifests and the CLI.

Every manifest is described; every alert is in the table with its severity; every
``shopping-agent`` command parses with the real CLI; every kubectl command names files and
objects that exist; the frontend's target and service config point at the headless Service.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import yaml

from server.app import SERVICE_NAME
from server.cli import parser
from tests.deploy.k8s_render import containers, render
from tests.harness import ROOT

DOC = ROOT / "docs" / "deploy.md"
K8S = ROOT / "k8s"


def text() -> str:
    return DOC.read_text()


def code_blocks(lang: str | None = None) -> list[str]:
    return [body for fence, body in re.findall(r"```(\w*)\n(.*?)```", text(), re.DOTALL) if lang is None or fence == lang]


def shell_commands() -> list[list[str]]:
    """Commands of the bash blocks, continuation lines joined, comments dropped, split at pipes."""
    commands = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if not line or line.startswith("#"):
                continue
            words = shlex.split(line, comments=True)
            current: list[str] = []
            for word in [*words, "|"]:
                if word == "|":
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(word)
    return commands


def prod() -> list[dict[str, Any]]:
    return render(K8S / "overlays" / "prod")


def test_every_manifest_file_is_described() -> None:
    files = [p for p in K8S.rglob("*") if p.is_file() and p.suffix in (".yaml", ".py") and "monitoring" not in p.parts]
    assert files
    for path in files:
        assert f"`{path.relative_to(ROOT).as_posix()}`" in text(), f"{path.relative_to(ROOT)} is not in docs/deploy.md"
    assert "`k8s/monitoring/README.md`" in text()


def test_every_alert_is_in_the_table_with_its_severity() -> None:
    rules = yaml.safe_load((K8S / "monitoring" / "alerts.yml").read_text())["groups"]
    alerts = {r["alert"]: r["labels"]["severity"] for g in rules for r in g["rules"] if "alert" in r}
    rows = dict(re.findall(r"^\| (ShoppingAgent\w+) \| (\w+) \|", text(), re.MULTILINE))
    assert rows == alerts


def test_every_shopping_agent_command_parses_with_the_real_cli() -> None:
    """In the bash blocks (run in a pod: after ``--``) and inline (`shopping-agent ...` in the prose and tables)."""
    lines = [words[words.index("--") + 1:] for words in shell_commands() if "--" in words]
    lines += [shlex.split(span) for span in re.findall(r"`(shopping-agent [^`]+)`", text())]
    lines = [words for words in lines if words and words[0] == "shopping-agent"]
    assert len(lines) >= 4
    for words in lines:
        args = [w.replace("VERSION", "v1").replace("<version>", "v1") for w in words[1:]]
        parsed = parser().parse_args(args)  # argparse exits (SystemExit) on anything it does not know
        assert parsed.command in ("serve", "cycle", "weights", "logs"), words


def test_the_documented_command_lines_are_the_manifests() -> None:
    docs = render(K8S / "base")
    for kind, name, first in (("Deployment", "shopping-agent", "serve"), ("CronJob", "shopping-agent-trainer", "cycle"),
                              ("CronJob", "shopping-agent-log-compactor", "logs compact")):
        [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
        [c] = containers(doc)
        args = " ".join(c["args"])
        assert args.startswith(first)
        assert f"`{args}`" in text() or f"`shopping-agent {args}`" in text(), f"docs/deploy.md does not show the {kind}'s {args!r}"


def test_kubectl_commands_name_files_and_objects_that_exist() -> None:
    docs = prod()
    [namespace] = {d["metadata"]["namespace"] for d in docs if "namespace" in d["metadata"]}
    names = {(d["kind"].lower(), d["metadata"]["name"]) for d in [*docs, *render(K8S / "jobs")]}
    secrets = {item["valueFrom"]["secretKeyRef"]["name"] for d in docs for c in containers(d)
               for item in c.get("env", []) if "secretKeyRef" in item.get("valueFrom", {})}
    aliases = {"deploy": "deployment", "deployment": "deployment", "cronjob": "cronjob", "job": "job"}
    kubectl = [w for w in shell_commands() if w and w[0] == "kubectl"]
    assert kubectl
    for words in kubectl:
        if "-n" in words:
            assert words[words.index("-n") + 1] == namespace, words
        for flag in ("-k", "-f"):
            if flag in words and words[words.index(flag) + 1] != "-":
                assert (ROOT / words[words.index(flag) + 1]).exists(), words
        verb = [w for w in words[1:] if not w.startswith("-") and w != namespace]
        if verb[0] == "kustomize":
            assert (ROOT / verb[1] / "kustomization.yaml").exists(), words
        for word in words:  # kind/name
            kind, slash, name = word.partition("/")
            if slash and kind in aliases:
                assert (aliases[kind], name) in names, word
        if verb[0] in ("patch", "delete") and verb[1] in ("cronjob", "job"):  # kind name
            assert (verb[1], verb[2]) in names, words
        if verb[:3] == ["create", "secret", "generic"]:
            assert verb[3] in secrets, words
    assert any(w[:2] == ["kubectl", "create"] and w[2:4] == ["-k", "k8s/jobs"] for w in kubectl), "the rollback command"


def test_the_frontend_example_targets_the_headless_service_with_round_robin() -> None:
    docs = prod()
    [headless] = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"]
    port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc")
    expected = f"dns:///{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local:{port}"
    [python] = code_blocks("python")
    assert expected in python
    config = re.search(r"SERVICE_CONFIG = json\.dumps\((\{.*?\})\)\n", python, re.DOTALL)
    assert config, "the Python example's service config"
    service_config = json.loads(re.sub(r",(\s*[}\]])", r"\1", config.group(1)))
    assert service_config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert service_config["methodConfig"][0]["name"] == [{"service": SERVICE_NAME}]
    frontend = "shopping-agent.io/client: frontend"
    assert frontend in text() and frontend in (K8S / "base" / "networkpolicy.yaml").read_text()
