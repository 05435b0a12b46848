"""Kubernetes manifests for a validated job: ``python launch.py ... k8s.render=DIR k8s.image=IMAGE``.

:func:`render_manifests` writes four files to ``DIR``, one YAML document each, numbered in the
order ``kubectl apply -f DIR`` must create them (it applies a directory's files in name order):

- ``00-configmap.yaml``: ``<name>-config``, the resolved config as ``config.yaml``, mounted at
  ``/etc/ckless`` (:data:`CONFIG_DIR`) and rewritten for the pods (:func:`pod_config`);
- ``01-secret.yaml``: ``<name>-store-secret``, a random token for the job's store, given to the
  container as ``CKLESS_JOB_SECRET`` (written with mode 0600);
- ``02-service.yaml``: ``<name>``, a headless Service over the job's pods: pod 0 is
  ``<name>-0.<name>``, the ``cluster.master_addr`` of every node;
- ``03-job.yaml``: ``<name>``, an Indexed Job of ``cluster.nnodes`` pods, pod ``i`` runs node
  ``i``'s agent (``launch.py ... cluster.node_rank=$(JOB_COMPLETION_INDEX)``). Exit 75 (fault
  budget spent) is ignored by the Job's podFailurePolicy: the pod is recreated without counting
  against ``backoffLimit`` (= ``agent.max_restarts``) and resumes from the last checkpoint in the
  run dir (which needs ``k8s.pvc``); exit 2 (bad config) and 3 (does not fit) fail the Job.

Nothing here talks to a cluster: the files are plain data for ``kubectl``.
"""

from __future__ import annotations

import math
import os
import secrets
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml

from ckless_lightning.deploy import K8sConfig
from ckless_lightning.runtime.contract import ExitCode

if TYPE_CHECKING:
    from ckless_lightning.runtime.config import JobConfig
    from ckless_lightning.runtime.memory_plan import MemoryPlan

__all__ = [
    "CONFIG_DIR",
    "CONTAINER_NAME",
    "CPU_PROCESS_BYTES",
    "DEFAULT_STORE_PORT",
    "GPU_PROCESS_BYTES",
    "SECRET_ENV",
    "SHM_BASE_BYTES",
    "K8sConfig",
    "memory_request",
    "pod_config",
    "render_manifests",
    "render_notes",
    "shm_bytes",
    "wants_gpus",
]

CONFIG_DIR = "/etc/ckless"
CONTAINER_NAME = "ckless"
SECRET_ENV = "CKLESS_JOB_SECRET"
SECRET_KEY = "token"
# The store port of a job whose cluster.master_port is 0 (pick a free one, one node only): a pod
# is reached through the Service's DNS name, so its port must be known when the files are written.
DEFAULT_STORE_PORT = 29400
_APP = "ckless-lightning"
_MIB = 1024**2
_GIB = 1024**3

# Host memory of one process besides what the memory plan counts. A process that imported the
# rank path (torch, Lightning, the project) has ~0.38 GiB resident on the CPU dev machine; a
# training rank adds gloo buffers, its data and Lightning's state: 1 GiB each for a CPU rank and
# for the pod's other processes (the agent, the fork server, the batch-cache reader, warm spares).
CPU_PROCESS_BYTES = 1 * _GIB
# A GPU rank also holds a CUDA context, the CUDA libraries' host allocations and NCCL's host
# buffers: 4 GiB, an estimate (not measured here; typical PyTorch GPU ranks hold 2-4 GiB of host RSS).
GPU_PROCESS_BYTES = 4 * _GIB
# /dev/shm beyond the batch cache: NCCL's shared-memory transport and torch's shared tensors
# (a container's default /dev/shm is 64 MiB, too small for NCCL within a node).
SHM_BASE_BYTES = 1 * _GIB


def wants_gpus(job: JobConfig) -> bool:
    """Whether the pods request GPUs: ``cluster.accelerator=gpu``; ``auto`` when the recipe is a
    GPU recipe (it sets ``cluster.device_memory_gib`` or an FSDP ``param_dtype``, as the GPU
    recipes do), since ``auto`` resolves in the pod and a pod sees CUDA only if it asked for GPUs.
    """
    accelerator = job.cluster.accelerator
    if accelerator == "auto":
        return job.cluster.device_memory_gib is not None or job.fsdp.param_dtype is not None
    return accelerator == "gpu"


def shm_bytes(job: JobConfig) -> int:
    """Size of the pod's ``/dev/shm`` (a memory-backed emptyDir): :data:`SHM_BASE_BYTES`, plus the
    tier-2 batch cache (``data.mmap_cache``) at its largest: every local rank's window of
    ``data.prefetch + data.lookback`` entries apart (ranks run within a step of each other, so
    this is far above what it holds), plus the entry being written. Rounded up to MiB."""
    total = SHM_BASE_BYTES
    if job.data.mmap_cache:
        from ckless_lightning.data.batch_cache import BatchCacheLayout

        nproc = job.cluster.nproc_per_node
        entry = BatchCacheLayout(
            root=Path(job.data.mmap_cache_base),
            dp_ranks=tuple(range(nproc)),
            micro_batch_size=job.data.micro_batch_size,
            row_len=job.data.seq_len + 1,
        ).entry_nbytes
        total += entry * (nproc * (job.data.prefetch + job.data.lookback) + 1)
    return math.ceil(total / _MIB) * _MIB


def memory_request(job: JobConfig, plan: MemoryPlan) -> tuple[int, list[str]]:
    """The memory request of one pod (bytes, rounded up to MiB) and the lines that explain it.

    The fit check (``memory_plan.check_fits``) lets state take at most ``HEADROOM`` (60 %) of a
    rank's memory, the rest being for activations, all-gathered blocks and buffers; the request
    applies the same rule to what lives in host RAM, per rank:

    - CPU ranks: the sharded state, tier 4's recovery buckets and host copies, all in RAM:
      ``(total + recovery_peak + host_copies) / HEADROOM``, plus :data:`CPU_PROCESS_BYTES`;
    - GPU ranks: the state is in GPU memory; host RAM holds tier 4's buddy copies (the fit check's
      host rule): ``host_copies / HEADROOM``, plus :data:`GPU_PROCESS_BYTES`.

    Then ``nproc_per_node`` ranks, :data:`CPU_PROCESS_BYTES` for each other process of the pod (the
    agent; the fork server with ``agent.fork_server``; the batch-cache reader with
    ``data.mmap_cache``; ``agent.spares`` warm spares), and the ``/dev/shm`` volume (its pages are
    charged to the pod): :func:`shm_bytes`. ``k8s.memory_gib`` replaces the total.
    """
    from ckless_lightning.runtime.memory_plan import HEADROOM

    if job.k8s.memory_gib is not None:
        total = int(job.k8s.memory_gib * _GIB)
        return math.ceil(total / _MIB) * _MIB, [f"k8s.memory_gib={job.k8s.memory_gib}: {_gib(total)}"]
    nproc = job.cluster.nproc_per_node
    if wants_gpus(job):
        state = plan.host_copy_bytes
        rank = math.ceil(state / HEADROOM) + GPU_PROCESS_BYTES
        why = f"tier-4 host copies {_gib(state)} / {HEADROOM} + GPU process {_gib(GPU_PROCESS_BYTES)}"
    else:
        state = plan.total_bytes + plan.recovery_peak_bytes + plan.host_copy_bytes
        rank = math.ceil(state / HEADROOM) + CPU_PROCESS_BYTES
        why = (
            f"sharded state + tier-4 buckets and host copies {_gib(state)} / {HEADROOM} "
            f"+ process {_gib(CPU_PROCESS_BYTES)}"
        )
    others = 1 + int(job.agent.fork_server) + int(job.data.mmap_cache) + job.agent.spares
    shm = shm_bytes(job)
    total = nproc * rank + others * CPU_PROCESS_BYTES + shm
    lines = [
        f"per rank: {_gib(rank)} ({why})",
        f"{nproc} ranks: {_gib(nproc * rank)}",
        f"{others} other processes (agent, fork server, batch-cache reader, spares as configured): "
        f"{_gib(others * CPU_PROCESS_BYTES)}",
        f"/dev/shm (memory-backed, charged to the pod): {_gib(shm)}",
        f"total: {_gib(total)}",
    ]
    return math.ceil(total / _MIB) * _MIB, lines


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def _store_port(job: JobConfig) -> int:
    return job.cluster.master_port or DEFAULT_STORE_PORT


def _rebase(value: Any, old: str, new: str) -> Any:
    """``value`` with every string that is the path ``old``, or a path under it, moved to ``new``."""
    if isinstance(value, dict):
        return {k: _rebase(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebase(v, old, new) for v in value]
    if isinstance(value, str) and (value == old or value.startswith(old.rstrip("/") + "/")):
        return str(PurePosixPath(new) / PurePosixPath(value).relative_to(old))
    return value


def pod_config(job: JobConfig, container: dict[str, Any]) -> dict[str, Any]:
    """The config the pods run: ``container`` (the resolved config) with ``run_dir`` =
    ``k8s.run_dir`` and every path under the old run dir moved under it (``checkpoint.dir``, the
    logger's ``save_dir``), ``cluster.master_addr`` = pod 0's DNS name ``<name>-0.<name>``,
    ``cluster.master_port`` fixed (:data:`DEFAULT_STORE_PORT` for 0), ``cluster.accelerator``
    resolved (gpu or cpu, as the pods' resources), ``cluster.node_rank`` 0 (each pod passes its
    own), ``k8s.render`` null (a pod must not render again) and ``dry_run`` false."""
    name = job.k8s.job_name(job.recipe)
    old = str(container.get("run_dir", job.run_dir))
    cfg = _rebase(dict(container), old, job.k8s.run_dir) if old not in ("", ".", "/") else dict(container)
    cfg["run_dir"] = job.k8s.run_dir
    cfg["dry_run"] = False
    cfg["cluster"] = {
        **cfg.get("cluster", {}),
        "master_addr": f"{name}-0.{name}",
        "master_port": _store_port(job),
        "node_rank": 0,
        "accelerator": "gpu" if wants_gpus(job) else "cpu",
    }
    cfg["k8s"] = {**cfg.get("k8s", {}), "render": None}
    return cfg


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": _APP, "app.kubernetes.io/instance": name}


def _metadata(name: str, namespace: str, instance: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": _labels(instance)}


def _job(job: JobConfig, name: str, memory: int) -> dict[str, Any]:
    k8s, cluster = job.k8s, job.cluster
    nproc = cluster.nproc_per_node
    port = _store_port(job)
    requests: dict[str, Any] = {"cpu": str(nproc), "memory": f"{memory // _MIB}Mi"}
    limits: dict[str, Any] = {}
    if wants_gpus(job):
        # An extended resource is requested in whole devices, and its request must equal its limit.
        requests[k8s.gpu_resource] = str(nproc)
        limits[k8s.gpu_resource] = str(nproc)
    # No memory limit: the request reserves the planned memory on the node, and a limit set from
    # an estimate would turn an underestimate into OOM kills that spend the fault budget.
    resources: dict[str, Any] = {"requests": requests, **({"limits": limits} if limits else {})}
    command = [
        "python",
        "launch.py",
        "--config-path",
        CONFIG_DIR,
        "--config-name",
        "config",
        "cluster.node_rank=$(JOB_COMPLETION_INDEX)",
        f"hydra.run.dir={k8s.run_dir}",
    ]
    env = [
        # The Job controller sets it for Indexed Jobs too; declared so that $(JOB_COMPLETION_INDEX)
        # above expands whatever the cluster's version (the controller keeps a declared one).
        {
            "name": "JOB_COMPLETION_INDEX",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
        {
            "name": SECRET_ENV,
            "valueFrom": {"secretKeyRef": {"name": f"{name}-store-secret", "key": SECRET_KEY}},
        },
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": k8s.image,
        "command": command,
        **({"workingDir": k8s.workdir} if k8s.workdir else {}),
        "env": env,
        "ports": [{"name": "store", "containerPort": port, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": k8s.run_dir},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    run_volume: dict[str, Any] = (
        {"name": "run", "persistentVolumeClaim": {"claimName": k8s.pvc}}
        if k8s.pvc
        else {"name": "run", "emptyDir": {}}
    )
    rules = [
        {
            "action": "FailJob",  # bad config or data, or the recipe does not fit: a retry fails the same way
            "onExitCodes": {
                "containerName": CONTAINER_NAME,
                "operator": "In",
                "values": [int(ExitCode.CONFIG), int(ExitCode.DOES_NOT_FIT)],
            },
        },
        {
            "action": "Ignore",  # fault budget spent: requeue, i.e. a new pod resumes from the checkpoint
            "onExitCodes": {
                "containerName": CONTAINER_NAME,
                "operator": "In",
                "values": [int(ExitCode.FAULT_BUDGET)],
            },
        },
        {
            "action": "Ignore",  # evicted, preempted or its node drained: not the job's fault
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        },
    ]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, k8s.namespace, name),
        "spec": {
            "completionMode": "Indexed",
            "completions": cluster.nnodes,
            "parallelism": cluster.nnodes,
            "backoffLimit": job.agent.max_restarts,
            "podFailurePolicy": {"rules": rules},
            "template": {
                "metadata": {"labels": _labels(name)},
                "spec": {
                    "restartPolicy": "Never",
                    "subdomain": name,  # pod i is <name>-i.<name> through the headless Service
                    # the agent stops its ranks within agent.stop_grace_s of SIGTERM, then reports
                    "terminationGracePeriodSeconds": math.ceil(job.agent.stop_grace_s) + 30,
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": f"{name}-config"}},
                        run_volume,
                        {
                            "name": "shm",
                            "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_bytes(job) // _MIB}Mi"},
                        },
                    ],
                },
            },
        },
    }


def _service(job: JobConfig, name: str) -> dict[str, Any]:
    port = _store_port(job)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, job.k8s.namespace, name),
        "spec": {
            "clusterIP": "None",
            "selector": _labels(name),
            # pods get DNS records before they are ready: the other nodes resolve pod 0 at start-up
            "publishNotReadyAddresses": True,
            "ports": [{"name": "store", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def _config_map(job: JobConfig, name: str, container: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(OmegaConf.create(pod_config(job, container)))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(f"{name}-config", job.k8s.namespace, name),
        "data": {"config.yaml": text},
    }


def _secret(job: JobConfig, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(f"{name}-store-secret", job.k8s.namespace, name),
        "type": "Opaque",
        "stringData": {SECRET_KEY: secrets.token_hex(32)},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's config.yaml) as literal blocks, readable in the file."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)


def _dump(doc: dict[str, Any], header: list[str]) -> str:
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header)
    return comments + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def render_manifests(
    job: JobConfig, container: dict[str, Any], out_dir: Path, *, plan: MemoryPlan | None = None
) -> list[Path]:
    """Write ``job``'s manifests to ``out_dir`` (created if missing); return the files written, in
    the order they apply (see the module docstring). Requires ``job.k8s.image``.

    ``job`` is the validated JobConfig of ``container``, the resolved config
    (``OmegaConf.to_container(cfg, resolve=True)``); ``plan`` is its memory plan (computed
    when None). Each call draws a new store secret. Raises ValueError when ``k8s.image`` is
    unset, OSError when ``out_dir`` cannot be written.
    """
    if not job.k8s.image:
        raise ValueError(
            "k8s.image: set the container image that has this project installed, "
            "e.g. k8s.image=registry/ckless:TAG"
        )
    if plan is None:
        from ckless_lightning.runtime.memory_plan import plan_job

        plan = plan_job(job)
    name = job.k8s.job_name(job.recipe)
    memory, why = memory_request(job, plan)
    source = (
        f"Rendered by ckless_lightning from recipe {job.recipe!r}; apply with: kubectl apply -f <this dir>"
    )
    docs = [
        ("00-configmap.yaml", _config_map(job, name, container), ["The resolved job config the pods run."]),
        (
            "01-secret.yaml",
            _secret(job, name),
            [f"The job store's secret, given to the pods as {SECRET_ENV}."],
        ),
        (
            "02-service.yaml",
            _service(job, name),
            [f"Headless: pod i is {name}-i.{name}; pod 0 hosts the store."],
        ),
        (
            "03-job.yaml",
            _job(job, name, memory),
            [
                f"{job.cluster.nnodes} pod(s), a node agent each; exit 75 requeues, 2 and 3 fail the Job.",
                "Memory request per pod:",
                *(f"  {line}" for line in why),
            ],
        ),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, doc, header in docs:
        path = out_dir / filename
        text = _dump(doc, [source, *header])
        if doc["kind"] == "Secret":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # also when the file was there with other bits
            with os.fdopen(fd, "w") as f:
                f.write(text)
        else:
            path.write_text(text)
        written.append(path)
    return written


def render_notes(job: JobConfig) -> list[str]:
    """What a user should know about the rendered files (printed by ``launch.py``)."""
    notes = []
    if job.fault.type != "none":
        notes.append(f"the config injects faults (fault.type={job.fault.type}); fault=none turns them off")
    if job.cluster.master_port == 0:
        notes.append(
            f"cluster.master_port=0: the pods use port {DEFAULT_STORE_PORT} (a Service needs a fixed port)"
        )
    if job.k8s.pvc is None:
        notes.append(
            "k8s.pvc is null: the run dir is an emptyDir that dies with its pod, so a requeued pod "
            "(exit 75) starts from step 0; set k8s.pvc=<claim> to resume from the last checkpoint"
        )
    elif job.cluster.nnodes > 1:
        notes.append(
            f"k8s.pvc={job.k8s.pvc} is mounted by {job.cluster.nnodes} pods: it must be ReadWriteMany"
        )
    return notes
