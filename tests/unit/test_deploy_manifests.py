"""The deployment files, checked offline.

- Every Kubernetes object in deploy/kubernetes/ against the API's schema for its kind: core
  kinds against kubernetes-validate's (strict: an unknown field fails, as `kubectl apply`'s
  field validation refuses it), the ServiceMonitor and the LeaderWorkerSet against their CRDs'
  schemas shipped in deploy/schemas/, closed the same way.
- Every command line a container runs, through the engine's own parsers (settings for `serve`,
  the proxy's for `proxy`), with the environment the container would have: the image's ENV from
  the Dockerfile, the manifest's variables, the values the downward API and LWS give, and
  Kubernetes' $(VAR) expansion. A renamed flag, a misspelt ENGINE_* variable or an invalid
  value fails here.
- What the parsed settings imply: probes on the port the engine listens on, a grace period
  longer than the drain, Services, budgets and monitors that select the pods they are for.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from engine.cli.proxy_cmd import _parser as proxy_parser
from engine.cli.proxy_cmd import parse_proxy_args
from engine.kv.transfer.secret import SECRET_ENV
from engine.settings import Settings, SettingsError, load_settings
from engine.settings.fields import FIELDS
from engine.settings.loading import CONFIG_ENV, ENV_ALIASES
from tests.deploy_files import ROOT, image_command, image_env

MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
SCHEMAS = ROOT / "deploy" / "schemas"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor-v1.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): SCHEMAS / "leaderworkerset-v1.json",
}
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests are meant for
# ENGINE_* variables that are no setting: the deployment secret and the healthcheck's URL.
OTHER_ENGINE_VARIABLES = {SECRET_ENV, CONFIG_ENV, "ENGINE_HEALTHCHECK_URL"}
# What the downward API would give, by field.
POD_FIELDS = {"status.podIP": "10.244.1.7", "metadata.name": "pod-0", "metadata.namespace": "ns"}
PRE_STOP_SLACK_S = 10  # the actors' own stop, after the drain


@functools.cache
def _documents() -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple(
        (path.name, doc)
        for path in MANIFESTS
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    )


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) for every object of every manifest; the caller's own copies."""
    return copy.deepcopy(list(_documents()))


def doc_id(entry: tuple[str, dict[str, Any]]) -> str:
    name, doc = entry
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


# ---- schemas -------------------------------------------------------------------------------


def closed(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists an object's fields (the API
    server's strict field validation), except where the CRD keeps unknown fields."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items() if key != "properties"}
    if "properties" in schema:  # keys there are field names, not keywords
        out["properties"] = {name: closed(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads(CRD_SCHEMAS[(api_version, kind)].read_text())
    return jsonschema.Draft7Validator(closed(schema))


def schema_problems(doc: dict[str, Any]) -> list[str]:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        errors = crd_validator(*key).iter_errors(doc)
        found = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
        for template in lws_templates(doc):  # the pod templates also as the core API reads them
            found += schema_problems({"apiVersion": "v1", "kind": "PodTemplate", **template})
        return found
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    return []


def lws_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    group = doc.get("spec", {}).get("leaderWorkerTemplate", {})
    return [
        {"metadata": {"name": part}, "template": group[part]}
        for part in ("leaderTemplate", "workerTemplate")
        if part in group
    ]


@pytest.mark.parametrize("entry", documents(), ids=doc_id)
def test_every_object_is_valid_for_its_kind(entry: tuple[str, dict[str, Any]]) -> None:
    _, doc = entry
    assert schema_problems(doc) == []


def test_the_schema_checks_refuse_an_unknown_field_of_each_kind() -> None:
    """The checks above are not vacuous: one misspelt field in each kind fails them."""
    seen: set[str] = set()
    for _, doc in documents():
        if doc["kind"] in seen:
            continue
        seen.add(doc["kind"])
        broken = copy.deepcopy(doc)
        spec = broken["spec"]
        if doc["kind"] == "LeaderWorkerSet":
            spec = spec["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        spec["replicaz"] = 1
        assert schema_problems(broken), f"{doc['kind']} took an unknown field"
    assert seen == {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"} | {
        "LeaderWorkerSet"
    }


# ---- the containers' command lines ---------------------------------------------------------


@dataclass
class Container:
    where: str
    spec: dict[str, Any]
    pod: dict[str, Any]
    labels: dict[str, str]
    env: dict[str, str]

    @property
    def argv(self) -> list[str]:
        args = self.spec.get("args", image_command()[1])
        return [expand(arg, self.env) for arg in args]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args: a defined variable's value; $$ is one $."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def container_env(spec: dict[str, Any], extra: dict[str, str]) -> dict[str, str]:
    env = {**image_env(), **extra}
    for entry in spec.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            env[entry["name"]] = POD_FIELDS[source["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            assert ref["resource"] == "limits.cpu" and str(ref.get("divisor", "1")) == "1"
            env[entry["name"]] = str(math.ceil(cpus(spec["resources"]["limits"]["cpu"])))
        elif "secretKeyRef" in source:
            env[entry["name"]] = "0" * 64
        else:
            raise AssertionError(f"unexpected valueFrom {source}")
    return env


def cpus(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """(which template, its pod spec, the env the platform adds) for each pod the object makes,
    LWS pods once per worker index (LWS sets LWS_* in every container)."""
    if doc["kind"] == "Deployment":
        yield "pod", doc["spec"]["template"], {}
    if doc["kind"] == "LeaderWorkerSet":
        group = doc["spec"]["leaderWorkerTemplate"]
        name = doc["metadata"]["name"]
        for index in range(group["size"]):
            template = group["leaderTemplate" if index == 0 else "workerTemplate"]
            lws = {
                "LWS_LEADER_ADDRESS": f"{name}-0.{name}.default",
                "LWS_GROUP_SIZE": str(group["size"]),
                "LWS_WORKER_INDEX": str(index),
            }
            labels = {"leaderworkerset.sigs.k8s.io/name": name}
            yield f"worker {index}", _with_labels(template, labels), lws


def _with_labels(template: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    out = copy.deepcopy(template)
    out.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    return out


def containers() -> list[Container]:
    found = []
    for name, doc in documents():
        for which, template, platform_env in pod_templates(doc):
            for spec in template["spec"]["containers"]:
                found.append(
                    Container(
                        where=f"{name}:{doc['metadata']['name']} {which} {spec['name']}",
                        spec=spec,
                        pod=template["spec"],
                        labels=template["metadata"]["labels"],
                        env=container_env(spec, platform_env),
                    )
                )
    return found


def engine_variable_problem(name: str) -> str | None:
    """Why an ENGINE_* variable would be ignored or refused by the engine, or None."""
    if not name.startswith("ENGINE_") or name in OTHER_ENGINE_VARIABLES or name in ENV_ALIASES:
        return None
    section, sep, field = name.removeprefix("ENGINE_").lower().partition("__")
    if sep and f"{section}.{field}" in FIELDS:
        return None
    return f"{name} names no setting (ENGINE_SECTION__FIELD)"


def serve_settings(container: Container) -> Settings:
    argv = container.argv
    assert argv[0] == "serve", f"{container.where}: runs {argv[0]!r}"
    settings, _ = load_settings(argv[1:], container.env)
    return settings


def test_every_command_line_is_one_the_engine_accepts() -> None:
    entrypoint, command = image_command()
    assert entrypoint == ["tini", "--", "engine"] and command == ["serve"]
    ran: dict[str, int] = {}
    for container in containers():
        for name in container.env:
            assert engine_variable_problem(name) is None, container.where
        argv = container.argv
        assert not [arg for arg in argv if "$(" in arg], f"{container.where}: unset variable"
        if argv[0] == "proxy":
            parse_proxy_args(argv[1:], container.env)
            proxy_flags = set(re.findall(r"--[a-z-]+", proxy_parser().format_help()))
            # argparse takes abbreviations: a flag renamed to a longer name would still parse.
            assert {a for a in argv if a.startswith("--")} <= proxy_flags, container.where
        else:
            serve_settings(container)
        ran[argv[0]] = ran.get(argv[0], 0) + 1
    assert ran == {"serve": 6, "proxy": 1}  # engine, prefill, decode, three LWS nodes; a proxy


def test_a_renamed_flag_or_misspelt_variable_fails_the_check() -> None:
    decode = next(c for c in containers() if "engine-decode" in c.where)
    decode.spec = {**decode.spec, "args": ["serve", "--kv-rolle", "decode"]}
    with pytest.raises(SettingsError, match="unknown flag --kv-rolle"):
        serve_settings(decode)
    assert engine_variable_problem("ENGINE_CAHCE__KV_CACHE_MEMORY") is not None
    assert engine_variable_problem("ENGINE_CACHE__KV_CACHE_MEMORY") is None
    with pytest.raises(SettingsError, match="ENGINE_CACHE__KV_CACHE_MEMROY"):
        load_settings([], {"ENGINE_CACHE__KV_CACHE_MEMROY": "1GiB"})


# ---- what the settings imply ---------------------------------------------------------------


def port_number(container: Container, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.spec.get("ports", [])}
    return int(ports[name])


def grace_covers_the_drain(container: Container, drain_timeout: float) -> None:
    pre_stop = container.spec["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = float(pre_stop[1]) + drain_timeout + PRE_STOP_SLACK_S
    assert container.pod["terminationGracePeriodSeconds"] >= needed, container.where


def probes_are(container: Container, port: int, startup: bool) -> None:
    probes = {kind: container.spec.get(f"{kind}Probe") for kind in ("readiness", "liveness")}
    assert probes["readiness"]["httpGet"]["path"] == "/ready", container.where
    assert probes["liveness"]["httpGet"]["path"] == "/health", container.where
    if startup:
        probes["startup"] = container.spec["startupProbe"]
    for probe in probes.values():
        assert port_number(container, probe["httpGet"]["port"]) == port, container.where


def test_probes_ports_grace_and_resources_follow_the_engine_settings() -> None:
    for container in containers():
        resources = container.spec["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) & set(resources["limits"])
        if container.argv[0] == "proxy":
            config = parse_proxy_args(container.argv[1:], container.env)
            probes_are(container, config.port, startup=False)
            grace_covers_the_drain(container, config.drain_timeout)
            continue
        settings = serve_settings(container)
        if settings.parallel.node_rank > 0:  # a worker node serves no HTTP: nothing to probe
            assert "readinessProbe" not in container.spec and "ports" not in container.spec
            continue
        probes_are(container, settings.server.port, startup=True)
        assert settings.server.host == "0.0.0.0", container.where
        grace_covers_the_drain(container, settings.server.drain_timeout)
        if settings.kv_transfer.role == "prefill":
            assert port_number(container, "kv-transfer") == settings.kv_transfer.port
        shm = next(v for v in container.pod["volumes"] if v["name"] == "shm")["emptyDir"]
        # A CPU rank's KV cache is a segment there, but on the nodes of a multi-host group.
        kv_in_shm = settings.cache.kv_cache_memory if settings.parallel.nnodes == 1 else 0
        assert quantity_bytes(shm["sizeLimit"]) > (kv_in_shm or 0) + 64 * 2**20, container.where


def quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(text[:-2]) * units[text[-2:]]


# ---- what selects what ---------------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    wanted = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(key) != value for key, value in wanted.items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_services_budgets_and_monitors_select_their_pods_and_ports() -> None:
    pods = containers()
    for name, doc in documents():
        kind, spec = doc["kind"], doc.get("spec", {})
        if kind == "Service":
            chosen = [c for c in pods if name in c.where and selects(spec["selector"], c.labels)]
            assert chosen, f"{name}: Service {doc['metadata']['name']} selects no pod"
            for port in spec["ports"]:
                assert all(port_number(c, port["targetPort"]) for c in chosen)
        elif kind == "PodDisruptionBudget":
            assert any(selects(spec["selector"], c.labels) for c in pods if name in c.where)
        elif kind == "ServiceMonitor":
            services = [
                d
                for n, d in documents()
                if n == name
                and d["kind"] == "Service"
                and selects(spec["selector"], d["metadata"]["labels"])
            ]
            assert services, f"{name}: ServiceMonitor {doc['metadata']['name']} selects nothing"
            for endpoint in spec["endpoints"]:
                assert endpoint["path"] == "/metrics"
                assert all(
                    endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services
                )
