"""One sampler per source: host (psutil), allocator (torch.cuda), NVML, latency probe, telemetry."""
