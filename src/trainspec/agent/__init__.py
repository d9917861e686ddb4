"""trainspec-agent: the per-node sidecar. One agent per node; training never depends on it.

Contract:
- One HTTP port (default 127.0.0.1:4318, the OTLP/HTTP port, so ranks find it through
  OTEL_EXPORTER_OTLP_ENDPOINT): OTLP ingest (`/v1/metrics`), raw rank batches
  (`/v1/trainspec/batches`), `/metrics`, the control API (`/v1/actions`, `/v1/status`),
  `/healthz`, `/readyz`. Loopback unless `allow_remote` and a bearer token are both set.
- Single writer of the run store on its node (writer `agent-<node>`): ranks' raw batches are
  group-committed as atomic segments and acknowledged only once renamed, so an acknowledged
  batch is durable and an unacknowledged one is written by the rank itself (fail open).
- Node sampling once for all ranks (NVML for every GPU, host CPU and memory) and the node
  inventory; without NVML it says so once and serves host metrics. Each GPU's readings are
  stored and exported as the rank that owns it (from the devices each rank reports); a GPU
  whose owner is unclear is stored for no one, said once.
- `/metrics` is bounded (`metrics_max_series`, drops counted) and forgets series left
  unchanged (`metrics_series_ttl_s`); its aggregation never delays a rank's answer.
- Bad input (garbage, truncated, oversized, wrong type, no token) gets a 4xx, is counted in
  `trainspec_agent_rejected_requests_total{reason}`, and never stops the agent.
- OTLP from ranks is forwarded upstream with retries, backoff and a bounded buffer; drops
  are counted and exported.

One concern per file: `settings` (configuration, bind policy), `auth`, `server` (HTTP and
routing), `ingest` (decoding and limits), `writer` (store), `node` (sampling, inventory),
`gpu_owners` (which rank owns which GPU), `exposition` (/metrics), `metrics_feed` (its
aggregation thread), `forward` (upstream), `control` (actions), `app` (assembly),
`main` (the console script). The rank side of the actions is not here: rank 0's poller is
`trainspec.runtime.agent_client`, applied on every rank by `runtime/operator_actions.py`.
"""
