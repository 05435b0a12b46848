"""Deploying a job to a cluster scheduler: the ``k8s`` config section (here) and its renderer.

``python launch.py recipe=NAME k8s.render=DIR k8s.image=IMAGE`` writes Kubernetes manifests
for the job to ``DIR`` (:func:`ckless_lightning.deploy.k8s.render_manifests`) instead of
running it; ``kubectl apply -f DIR`` starts it. :class:`K8sConfig` lives in this package's
``__init__`` and imports nothing of the project: ``runtime.config`` builds it as a section of
the job config, and the renderer (``deploy.k8s``) uses the memory plan, which uses
``runtime.config``: keeping the section here keeps the import graph free of cycles.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

__all__ = ["NAME_MAX", "K8sConfig", "dns_label"]

# A job of this name has pods named (and hostnames) <name>-<index>, a DNS-1123 label of at most
# 63 characters: 56 leaves room for "-" and a six-digit node index.
NAME_MAX = 56
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a Service name also starts with a letter
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# An extended resource name: <domain>/<name>, e.g. nvidia.com/gpu, amd.com/gpu.
_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def dns_label(text: str, max_len: int = NAME_MAX) -> str:
    """``text`` made a DNS-1123 label that starts with a letter: lower case, runs of other
    characters as one ``-``, at most ``max_len`` characters; ``"x"`` when nothing is left."""
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    label = label.lstrip("0123456789-") or "x"
    return label[:max_len].rstrip("-")


@dataclass
class K8sConfig:
    """The ``k8s`` section: render Kubernetes manifests for the job instead of running it.

    ``render``: the output directory; null (the default) turns rendering off. With it set,
    ``launch.py`` validates and plans the job, writes the manifests (see
    :func:`ckless_lightning.deploy.k8s.render_manifests`) and exits 0: no rank starts, no data
    is prepared. ``image`` (required then) is a container image with this project installed,
    its ``launch.py`` in ``workdir`` (null: the image's working directory). ``name`` (null:
    ``ckless-<recipe>``) names the Job, its headless Service, ConfigMap and Secret.

    ``run_dir`` is where each pod writes the run (the job's ``run_dir`` in the rendered
    config). ``pvc`` names a PersistentVolumeClaim mounted there; null mounts an emptyDir,
    which dies with the pod: a requeued pod (exit 75) then starts from step 0. Resuming from
    the last checkpoint needs a PVC, and with several nodes a ReadWriteMany one (every node
    writes its shards of a checkpoint into the same directory). ``memory_gib`` overrides the
    memory request per pod (null: from the memory plan).
    """

    render: str | None = None
    image: str | None = None
    namespace: str = "default"
    name: str | None = None
    run_dir: str = "/workspace/run"
    pvc: str | None = None
    gpu_resource: str = "nvidia.com/gpu"
    workdir: str | None = None
    memory_gib: float | None = None

    def __post_init__(self) -> None:
        if self.render is not None and not str(self.render).strip():
            raise ValueError(
                "k8s.render is empty; set the directory to write the manifests to, or null (off)"
            )
        if self.render is not None and not self.image:
            raise ValueError(
                "k8s.image: set the container image that has this project installed, "
                "e.g. k8s.image=registry/ckless:TAG"
            )
        if not _DNS_LABEL.match(str(self.namespace)) or len(self.namespace) > 63:
            raise ValueError(
                f"k8s.namespace={self.namespace!r} is not a Kubernetes namespace name "
                "(lower-case letters, digits and '-', at most 63); e.g. k8s.namespace=training"
            )
        if self.name is not None and (not _DNS_1035.match(str(self.name)) or len(self.name) > NAME_MAX):
            raise ValueError(
                f"k8s.name={self.name!r} must be a DNS-1123 label that starts with a letter "
                f"(lower-case letters, digits and '-', at most {NAME_MAX} characters); "
                f"e.g. k8s.name={dns_label(str(self.name))}, or null for ckless-<recipe>"
            )
        for key in ("run_dir", "workdir"):
            value = getattr(self, key)
            if value is not None and not PurePosixPath(str(value)).is_absolute():
                raise ValueError(
                    f"k8s.{key}={value!r} must be an absolute path in the container, e.g. /workspace"
                )
        if PurePosixPath(self.run_dir) == PurePosixPath("/"):
            raise ValueError(
                "k8s.run_dir=/ would mount the run volume over the container's root; use e.g. /workspace/run"
            )
        if self.pvc is not None and (not _DNS_SUBDOMAIN.match(str(self.pvc)) or len(self.pvc) > 253):
            raise ValueError(
                f"k8s.pvc={self.pvc!r} is not a PersistentVolumeClaim name (lower-case DNS-1123); "
                "give the claim's name, or null for an emptyDir (no resume after a requeue)"
            )
        if not _RESOURCE.match(str(self.gpu_resource)):
            raise ValueError(
                f"k8s.gpu_resource={self.gpu_resource!r} is not an extended resource name "
                "<domain>/<name>; e.g. nvidia.com/gpu or amd.com/gpu"
            )
        if self.memory_gib is not None and not self.memory_gib > 0:
            raise ValueError(
                f"k8s.memory_gib={self.memory_gib!r} must be a positive number of GiB, "
                "or null (from the memory plan)"
            )

    def job_name(self, recipe: str) -> str:
        """``name``, or ``ckless-<recipe>`` made a DNS-1123 label (``ckless-llama3-tiny``)."""
        return self.name if self.name is not None else dns_label(f"ckless-{recipe}")
