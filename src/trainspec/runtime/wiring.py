"""Build one rank's samplers and sinks from the configuration."""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

from trainspec.collector.sampler import Sampler
from trainspec.collector.samplers.allocator import AllocatorSampler
from trainspec.collector.samplers.host import HostSampler
from trainspec.collector.samplers.latency import LatencyProbeSampler
from trainspec.collector.samplers.nvml import NvmlSampler, visible_nvml_indices
from trainspec.collector.sink import Sink
from trainspec.collector.sinks.agent import AgentSink, agent_endpoint
from trainspec.collector.sinks.store import StoreSink
from trainspec.config import TrainspecConfig
from trainspec.runtime.groups import SideGroups
from trainspec.runtime.identity import RankIdentity
from trainspec.store.errors import StoreError
from trainspec.store.tables import to_arrow

log = logging.getLogger("trainspec.runtime")


def build_samplers(
    cfg: TrainspecConfig, ident: RankIdentity, *, cuda: bool, groups: SideGroups | None
) -> tuple[list[Sampler], LatencyProbeSampler | None, NvmlSampler | None]:
    interval = cfg.collector.interval_s
    samplers: list[Sampler] = [HostSampler(interval_s=interval, memory_pressure=not cuda)]
    nvml = None
    if cuda:
        samplers.append(AllocatorSampler(ident.local_rank, interval_s=interval))
    # In sidecar mode the node's agent samples every GPU once for all ranks.
    if cuda and cfg.collector.nvml and cfg.collector.mode != "sidecar":
        nvml = NvmlSampler(visible_nvml_indices(ident.local_rank), interval_s=interval)
        samplers.append(nvml)
    probe = None
    if groups is not None and cfg.collector.probe:
        probe = LatencyProbeSampler(
            groups.probe, interval_s=interval, timeout_s=cfg.collector.probe_timeout_s
        )
        samplers.append(probe)
    return samplers, probe, nvml


def build_sinks(
    cfg: TrainspecConfig, ident: RankIdentity, run_dir: Path, resource: dict[str, Any]
) -> tuple[list[Sink], StoreSink | AgentSink | None]:
    """The rank's sinks and its store (None when the run store cannot be written)."""
    store: StoreSink | AgentSink | None = None
    if cfg.collector.mode == "sidecar":
        try:
            store = AgentSink(
                agent_endpoint(cfg.agent.endpoint),
                run_id=str(resource["trainspec.run.id"]),
                rank=ident.rank,
                run_dir=run_dir,
                writer=ident.writer,
                fanout=cfg.store.merge_fanout,
                timeout_s=cfg.agent.timeout_s,
                retry_after_s=cfg.agent.retry_after_s,
                service=str(resource.get("service.name", "trainspec")),
            )
        except ValueError as exc:
            log.warning("trainspec: sidecar mode off, writing this rank's store: %s", exc)
    elif cfg.collector.mode != "embedded":
        log.warning("trainspec: collector.mode %r unknown; embedded", cfg.collector.mode)
    if store is None:
        try:
            store = StoreSink(
                run_dir,
                ident.writer,
                fanout=cfg.store.merge_fanout,
                journal_rank=ident.rank if cfg.store.journal else None,
            )
        except StoreError as exc:  # a root that is a file, a read-only disk: train on
            log.warning("trainspec: run store off, nothing of this rank is stored: %s", exc)
    sinks: list[Sink] = [store] if store is not None else []
    if cfg.collector.prometheus_port:
        from trainspec.collector.sinks.prometheus import PrometheusSink

        port = cfg.collector.prometheus_port + ident.local_rank
        try:
            labels = {k: str(v) for k, v in resource.items()}
            sinks.append(PrometheusSink(labels, port=port, addr=cfg.collector.prometheus_addr))
        # A taken port (OSError) or one past 65535 (base + local rank; OverflowError) must not
        # stop training.
        except (OSError, OverflowError, ValueError) as exc:  # a bad address too (gaierror)
            log.warning(
                "trainspec: Prometheus endpoint on %s:%d unavailable: %s",
                cfg.collector.prometheus_addr,
                port,
                exc,
            )
    from trainspec.collector.sinks.otel import otel_enabled

    if otel_enabled(cfg.collector.otel):
        try:
            from trainspec.collector.sinks.otel import OTelSink, otlp_protocol
            from trainspec.collector.sinks.otlp_auth import agent_export_headers, exports_to

            headers = protocol = None
            if cfg.collector.mode == "sidecar":  # the exports go to the agent: its token
                token = os.environ.get("TRAINSPEC_AGENT_TOKEN")
                endpoint = agent_endpoint(cfg.agent.endpoint)
                headers = agent_export_headers(os.environ, endpoint, token)
                if exports_to(os.environ, endpoint):  # the agent speaks OTLP/HTTP only
                    protocol = _agent_protocol(otlp_protocol(os.environ))
            sinks.append(OTelSink(resource, headers=headers, protocol=protocol))
        except ImportError as exc:
            log.warning("trainspec: OpenTelemetry off: %s (pip install 'trainspec[otel]')", exc)
        except Exception as exc:  # the SDK refuses a bad OTEL_* value: not the job's end
            log.warning("trainspec: OpenTelemetry off: %s", exc)
    return sinks, store


def _agent_protocol(asked: str) -> str:
    """The OTLP protocol for exports to trainspec-agent: http/protobuf, the one it serves,
    whatever OTEL_EXPORTER_OTLP[_METRICS]_PROTOCOL asks for (said when it asks for another)."""
    if asked != "http/protobuf":
        log.warning("trainspec: OTLP exports go to trainspec-agent, which speaks OTLP over "
                    "HTTP (protobuf): protocol %r not used for them", asked)  # fmt: skip
    return "http/protobuf"


def run_row(
    cfg: TrainspecConfig,
    ident: RankIdentity,
    run_id: str,
    *,
    device: str,
    gpus: list[dict[str, Any]],
) -> Any:
    import torch
    import torch.distributed as dist

    versions = {
        "trainspec": _version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    return to_arrow(
        "runs",
        {
            "run_id": [run_id],
            "rank": [ident.rank],
            "local_rank": [ident.local_rank],
            "world_size": [ident.world_size],
            "host": [ident.host],
            "started_at": [time.time()],
            "device": [device],
            "gpus": [json.dumps(gpus)],
            "config": [config_json(cfg, dist.is_available() and dist.is_initialized())],
            "versions": [json.dumps(versions)],
        },
    )


def config_json(cfg: TrainspecConfig, process_group: bool) -> str:
    """The runs row's `config`: the settings the rank ran with, `process_group`, whether it
    had one (false: each rank measured on its own, `init(create_process_group=False)` or a
    torchrun worker that made none; the validator then requires no `distributed` metric of
    it, as it communicates with no rank), and `restart`, torchrun's restart count (a restart
    that found no checkpoint runs steps 0.. again, which the validator then expects)."""
    from trainspec.runtime.identity import restart_count

    settings = {**cfg.to_dict(), "process_group": process_group, "restart": restart_count()}
    return json.dumps(settings, sort_keys=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainspec")
    except PackageNotFoundError:
        return "unknown"
