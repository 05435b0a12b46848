"""``k8s.render``: the Kubernetes manifests of a job, checked against the official client's models.

Every rendered document is deserialized into its ``kubernetes.client`` model (V1Job, V1Service,
V1ConfigMap, V1Secret) and serialized back: equal to the file means no field was misspelled or
misplaced (the models drop what they do not know). Jobs are built from composed configs, without
launching, except for the two ``launch.py`` runs at the end.
"""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from conftest import compose_config, launch_command

from ckless_lightning.deploy import NAME_MAX, K8sConfig, dns_label
from ckless_lightning.deploy.k8s import (
    CPU_PROCESS_BYTES,
    DEFAULT_STORE_PORT,
    GPU_PROCESS_BYTES,
    SECRET_ENV,
    memory_request,
    render_manifests,
    shm_bytes,
)
from ckless_lightning.runtime.config import build_section, job_config_from_dict
from ckless_lightning.runtime.memory_plan import HEADROOM, plan_job

FILES = {
    "00-configmap.yaml": "ConfigMap",
    "01-secret.yaml": "Secret",
    "02-service.yaml": "Service",
    "03-job.yaml": "Job",
}
LABELS = {"app.kubernetes.io/name": "ckless-lightning"}
_MIB = 1024**2


API = kubernetes.client.ApiClient()


def strict_load(path: Path, kind: str) -> dict[str, Any]:
    """The file's one document, after checking it round-trips through the client's ``V1<kind>``."""
    docs = list(yaml.safe_load_all(path.read_text()))
    assert len(docs) == 1, f"{path}: one document per file"
    doc = docs[0]
    assert doc["kind"] == kind
    model = API._ApiClient__deserialize(doc, f"V1{kind}")  # private, but what a response goes through
    assert isinstance(model, getattr(kubernetes.client, f"V1{kind}"))
    assert API.sanitize_for_serialization(model) == doc, f"{path}: a field the V1{kind} model does not know"
    return doc


def render(tmp_path: Path, *overrides: str) -> tuple[Any, dict[str, dict[str, Any]]]:
    """Compose ``overrides`` (as launch.py would), render to ``tmp_path/k8s``: (job, {kind: doc})."""
    container = compose_config(["k8s.image=registry/ckless:test", *overrides], tmp_path / "run")
    job = job_config_from_dict(container)
    out = tmp_path / "k8s"
    written = render_manifests(job, container, out)
    assert [p.name for p in written] == list(FILES)
    return job, {kind: strict_load(out / name, kind) for name, kind in FILES.items()}


def pod_spec(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return docs["Job"]["spec"]["template"]["spec"]


def rendered_config(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])


@pytest.mark.timeout(120)
def test_cpu_recipe_manifests(tmp_path):
    job, docs = render(tmp_path)  # the default recipe: llama3_tiny, 1 node x 4 CPU ranks, tier 4
    name = "ckless-llama3-tiny"
    for kind, doc in docs.items():
        assert doc["metadata"]["labels"] == {**LABELS, "app.kubernetes.io/instance": name}, kind
        assert doc["metadata"]["namespace"] == "default"
    assert docs["Job"]["metadata"]["name"] == docs["Service"]["metadata"]["name"] == name

    spec = docs["Job"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 1
    assert spec["backoffLimit"] == job.agent.max_restarts == 3
    rules = spec["podFailurePolicy"]["rules"]
    by_code = {code: r["action"] for r in rules if "onExitCodes" in r for code in r["onExitCodes"]["values"]}
    assert by_code == {75: "Ignore", 2: "FailJob", 3: "FailJob"}
    assert all(r["onExitCodes"]["operator"] == "In" for r in rules if "onExitCodes" in r)
    conditions = [c for r in rules if r["action"] == "Ignore" for c in r.get("onPodConditions", [])]
    assert conditions == [{"type": "DisruptionTarget", "status": "True"}]

    pod = pod_spec(docs)
    assert pod["restartPolicy"] == "Never"
    assert pod["subdomain"] == docs["Service"]["metadata"]["name"]
    assert spec["template"]["metadata"]["labels"] == docs["Service"]["spec"]["selector"]
    (container,) = pod["containers"]
    assert container["image"] == "registry/ckless:test"
    command = container["command"]
    assert command[:2] == ["python", "launch.py"]
    assert "cluster.node_rank=$(JOB_COMPLETION_INDEX)" in command
    assert command[command.index("--config-path") + 1] == "/etc/ckless"
    assert command[command.index("--config-name") + 1] == "config"
    assert "hydra.run.dir=/workspace/run" in command
    env = {e["name"]: e for e in container["env"]}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )

    # the secret: a random token, to the container through a secretKeyRef
    ref = env[SECRET_ENV]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == docs["Secret"]["metadata"]["name"] == f"{name}-store-secret"
    token = docs["Secret"]["stringData"][ref["key"]]
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE((tmp_path / "k8s" / "01-secret.yaml").stat().st_mode) == 0o600
    _, again = render(tmp_path / "again")
    assert again["Secret"]["stringData"][ref["key"]] != token

    # the headless service: the store port (master_port 0 -> the default port)
    svc = docs["Service"]["spec"]
    assert svc["clusterIP"] == "None"
    assert [(p["port"], p["targetPort"]) for p in svc["ports"]] == [(DEFAULT_STORE_PORT, DEFAULT_STORE_PORT)]
    assert container["ports"][0]["containerPort"] == DEFAULT_STORE_PORT

    # resources: CPU recipe: no GPU; cpu = ranks; memory from the plan (state in RAM / HEADROOM)
    requests = container["resources"]["requests"]
    assert set(requests) == {"cpu", "memory"} and "limits" not in container["resources"]
    assert requests["cpu"] == "4"
    plan = plan_job(job)
    per_rank = (plan.total_bytes + plan.recovery_peak_bytes + plan.host_copy_bytes) / HEADROOM
    others = 4  # agent, fork server, batch-cache reader (tier 4), one spare
    expected = 4 * (per_rank + CPU_PROCESS_BYTES) + others * CPU_PROCESS_BYTES + shm_bytes(job)
    memory = int(requests["memory"].removesuffix("Mi")) * _MIB
    assert expected <= memory < expected + 2 * _MIB
    assert memory == memory_request(job, plan)[0]

    # volumes: the config, the run dir (emptyDir without k8s.pvc), /dev/shm in memory with the cache
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"config": "/etc/ckless", "run": "/workspace/run", "shm": "/dev/shm"}
    assert volumes["config"]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert volumes["run"] == {"name": "run", "emptyDir": {}}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert job.data.mmap_cache and shm_bytes(job) > 1024 * _MIB
    assert volumes["shm"]["emptyDir"]["sizeLimit"] == f"{shm_bytes(job) // _MIB}Mi"

    # the config the pods run
    cfg = rendered_config(docs)
    assert cfg["cluster"]["master_addr"] == f"{name}-0.{name}"
    assert cfg["cluster"]["master_port"] == DEFAULT_STORE_PORT
    assert cfg["cluster"]["accelerator"] == "cpu"
    assert cfg["run_dir"] == "/workspace/run"
    assert cfg["checkpoint"]["dir"] == "/workspace/run/checkpoints"
    assert cfg["logger"]["save_dir"] == "/workspace/run"
    assert cfg["k8s"]["render"] is None and cfg["dry_run"] is False
    assert str(tmp_path) not in docs["ConfigMap"]["data"]["config.yaml"]


@pytest.mark.timeout(120)
def test_gpu_recipe_on_two_nodes(tmp_path):
    job, docs = render(
        tmp_path,
        "recipe=llama3_8b",
        "cluster.nnodes=2",
        "cluster.replicate=2",
        "k8s.pvc=ckless-runs",
        "k8s.namespace=training",
        "checkpoint.dir=/data/ckpt",
    )
    name = "ckless-llama3-8b"
    spec = docs["Job"]["spec"]
    assert spec["completions"] == spec["parallelism"] == 2
    pod = pod_spec(docs)
    (container,) = pod["containers"]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "8"
    assert resources["requests"]["cpu"] == "8"
    # GPU ranks: no host copies with HSDP (tier 4's source is the replica): a process each
    plan = plan_job(job)
    assert plan.host_copy_bytes == 0
    expected = 8 * GPU_PROCESS_BYTES + 4 * CPU_PROCESS_BYTES + shm_bytes(job)
    assert int(resources["requests"]["memory"].removesuffix("Mi")) * _MIB == expected
    assert {v["name"]: v for v in pod["volumes"]}["run"]["persistentVolumeClaim"] == {
        "claimName": "ckless-runs"
    }
    assert all(doc["metadata"]["namespace"] == "training" for doc in docs.values())
    assert docs["Service"]["spec"]["ports"][0]["port"] == 29500  # the recipe's fixed port
    cfg = rendered_config(docs)
    assert cfg["cluster"]["master_addr"] == f"{name}-0.{name}"
    assert (cfg["cluster"]["nnodes"], cfg["cluster"]["accelerator"]) == (2, "gpu")
    assert cfg["checkpoint"]["dir"] == "/data/ckpt"  # not under the old run dir: kept


@pytest.mark.timeout(120)
def test_memory_override_and_auto_accelerator(tmp_path):
    # accelerator=auto on a GPU recipe (device_memory_gib set) requests GPUs; on the tiny one, none
    _, docs = render(tmp_path / "a", "recipe=llama3_8b", "cluster.accelerator=auto", "k8s.memory_gib=100")
    resources = pod_spec(docs)["containers"][0]["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": "8"}
    assert resources["requests"]["memory"] == f"{100 * 1024}Mi"
    _, docs = render(tmp_path / "b", "cluster.accelerator=auto", "k8s.gpu_resource=amd.com/gpu")
    assert "limits" not in pod_spec(docs)["containers"][0]["resources"]
    assert rendered_config(docs)["cluster"]["accelerator"] == "cpu"


@pytest.mark.timeout(120)
def test_rendered_config_composes_back(tmp_path):
    """The ConfigMap's config.yaml is what the pods' Hydra composes: a valid job, node rank from the pod."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    _, docs = render(tmp_path, "recipe=llama3_8b", "cluster.nnodes=2", "cluster.replicate=2")
    cfg = rendered_config(docs)
    job = job_config_from_dict(cfg)
    assert job.cluster.node_rank == 0 and job.k8s.render is None and not job.dry_run
    assert (
        job.run_dir == "/workspace/run" and job.cluster.master_addr == "ckless-llama3-8b-0.ckless-llama3-8b"
    )

    config_dir = tmp_path / "etc_ckless"
    config_dir.mkdir()
    (config_dir / "config.yaml").write_text(docs["ConfigMap"]["data"]["config.yaml"])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        composed = compose(config_name="config", overrides=["cluster.node_rank=1"])
    GlobalHydra.instance().clear()
    pod_job = job_config_from_dict(OmegaConf.to_container(composed, resolve=True))
    assert pod_job.cluster.node_rank == 1 and pod_job.cluster.nnodes == 2


def test_k8s_config_validation():
    assert K8sConfig().render is None
    assert K8sConfig().job_name("llama3_tiny") == "ckless-llama3-tiny"
    assert K8sConfig(name="my-job").job_name("llama3_tiny") == "my-job"
    assert dns_label("ckless-Mixtral_8x22B") == "ckless-mixtral-8x22b"
    assert len(K8sConfig().job_name("x" * 100)) <= NAME_MAX
    with pytest.raises(ValueError, match=r"k8s\.image: set the container image"):
        K8sConfig(render="out")
    for key, value in [
        ("name", "My_Job"),
        ("name", "9lives"),
        ("name", "a" * (NAME_MAX + 1)),
        ("namespace", "Train"),
        ("run_dir", "relative/run"),
        ("pvc", "Bad_Claim"),
        ("gpu_resource", "gpu"),
        ("memory_gib", 0),
    ]:
        with pytest.raises(ValueError, match=rf"k8s\.{key}="):
            K8sConfig(**{key: value})
    with pytest.raises(ValueError, match=r"k8s\.imag\b"):
        build_section(K8sConfig, {"imag": "x"}, "k8s")


@pytest.mark.timeout(180)
def test_launch_renders_and_starts_nothing(tmp_path, data_cache):
    out = tmp_path / "manifests"
    run_dir = tmp_path / "run"
    result = subprocess.run(
        launch_command(run_dir, data_cache, f"k8s.render={out}", "k8s.image=x"),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert f"kubectl apply -f {out}" in result.stdout
    assert not (run_dir / "rank_logs" / "rank0.log").exists()
    assert not list(run_dir.glob("rank_logs/*")), "no rank, spare or fork server"


@pytest.mark.timeout(180)
def test_launch_without_image_exits_2(tmp_path, data_cache):
    out = tmp_path / "manifests"
    result = subprocess.run(
        launch_command(tmp_path / "run", data_cache, f"k8s.render={out}"),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 2, result.stderr[-4000:]
    assert "k8s.image" in result.stderr
    assert not out.exists()
