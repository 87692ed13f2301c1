"""Several machines: every node must train the same job, and every node must come.

Each machine runs its own launcher with its own copy of the config and the dataset. Before any worker
starts, each launcher puts what it will train - the config (less the fields that are per machine by
nature), the dataset listing (each image's concept, name and content hash, and its caption), and how many
processes it starts - under `node-<k>` in the run's rendezvous store (served by node 0), then waits
for every other node's. A node that differs stops every node with one message that names the node
and the fields or files that differ; a node that never comes ends the others after
`multi_gpu.timeout_minutes` with a message naming it. Torch is needed only for the store.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass

PER_NODE_FIELDS = (("multi_gpu", "node_rank"), ("multi_gpu", "num_gpus"), ("multi_gpu", "device_indexes"),
                   ("multi_gpu", "batch_split"), ("general", "cache_dir"))
"""Config fields that may differ between machines: the machine's number, its own GPUs (a node may use
fewer), and where it caches (a cache folder on local disk works: each node keeps what its ranks read)."""
KEY_PREFIX = "tandem-nodes/"
SHOWN = 5
"""Differing fields or files named in the message (then a count)."""


class NodeMismatch(RuntimeError):
    """The machines would not train the same job, or one never came; the message says which and what."""


@dataclass(frozen=True)
class NodeJob:
    """What one machine will train."""
    node_rank: int
    config: dict
    dataset: list[list[str]]
    """Per image: concept, file name, content hash, caption hash."""
    processes: int

    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.config, self.dataset], sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps({"node_rank": self.node_rank, "config": self.config, "dataset": self.dataset,
                           "processes": self.processes})

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeJob:
        return cls(**json.loads(text))


def node_job(cfg, dataset, processes: int) -> NodeJob:
    """This machine's job: `cfg` (a TrainConfig) without its per-machine fields, `dataset` as scanned here."""
    from modules.config import config_to_dict

    config = config_to_dict(cfg)
    for section, name in PER_NODE_FIELDS:
        config.get(section, {}).pop(name, None)
    listing = sorted([image.concept, image.path.name, image.content_hash,
                      hashlib.sha256(image.caption.encode()).hexdigest()[:16]] for image in dataset.images)
    return NodeJob(cfg.multi_gpu.node_rank, config, listing, processes)


def differences(reference: NodeJob, other: NodeJob) -> list[str]:
    """What `other` would train differently from `reference` (node 0), in words a user can act on."""
    found = []
    for section in sorted(set(reference.config) | set(other.config)):
        ours, theirs = reference.config.get(section, {}), other.config.get(section, {})
        if not isinstance(ours, dict) or not isinstance(theirs, dict):
            if ours != theirs:
                found.append(f"{section}: {theirs!r} instead of {ours!r}")
            continue
        for name in sorted(set(ours) | set(theirs)):
            if ours.get(name) != theirs.get(name):
                found.append(f"{section}.{name} = {_short(theirs.get(name))} (node 0: {_short(ours.get(name))})")
    if reference.dataset != other.dataset:
        ours = {tuple(entry[:2]): entry for entry in reference.dataset}
        theirs = {tuple(entry[:2]): entry for entry in other.dataset}
        files = [f"{c}/{n}: {'missing' if (c, n) not in theirs else 'not on node 0' if (c, n) not in ours else 'other content or caption'}"
                 for (c, n) in sorted(set(ours) | set(theirs)) if ours.get((c, n)) != theirs.get((c, n))]
        found.append(f"the dataset ({len(other.dataset)} images, node 0: {len(reference.dataset)}): "
                     + "; ".join(files[:SHOWN]) + (f"; and {len(files) - SHOWN} more" if len(files) > SHOWN else ""))
    return found


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def agree(store, job: NodeJob, nnodes: int, timeout: datetime.timedelta, where: str) -> list[NodeJob]:
    """Publish this machine's job, wait for every node's and check they agree; the jobs by node rank.

    Raises NodeMismatch naming the node and what differs, or the nodes that did not come in `timeout`."""
    store.set(f"{KEY_PREFIX}node-{job.node_rank}", job.to_json())
    keys = [f"{KEY_PREFIX}node-{k}" for k in range(nnodes)]
    store.set_timeout(timeout)
    try:
        store.wait(keys, timeout)
    except Exception as e:  # noqa: BLE001 - the store's timeout is a plain RuntimeError/DistStoreError
        if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
            raise
        missing = [k for k in range(nnodes) if not store.check([f"{KEY_PREFIX}node-{k}"])]
        raise NodeMismatch(
            f"node(s) {', '.join(map(str, missing))} of {nnodes} did not join the rendezvous at {where} within "
            f"multi_gpu.timeout_minutes = {timeout.total_seconds() / 60:g}: start scripts/train_multi_gpu.py with "
            f"the same config and --node-rank {missing[0] if missing else 1} on that machine, and check that it "
            "reaches this address and port (firewall, multi_gpu.master_addr).") from None
    jobs = [NodeJob.from_json(store.get(key)) for key in keys]
    reference = jobs[0]
    for other in jobs[1:]:
        found = differences(reference, other)
        if found:
            raise NodeMismatch(
                f"node {other.node_rank} would train another job than node 0 - every machine needs the same "
                f"config and dataset (only {', '.join('.'.join(f) for f in PER_NODE_FIELDS)} may differ): "
                + "; ".join(found[:SHOWN]) + (f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else ""))
    counts = {j.processes for j in jobs}
    if len(counts) > 1:
        raise NodeMismatch("the machines would start different numbers of processes ("
                           + ", ".join(f"node {j.node_rank}: {j.processes}" for j in jobs)
                           + "): Tandem needs the same number on each; set multi_gpu.num_gpus to the same count on all.")
    return jobs
