"""`trainspec-agent` as a user starts it: methods it does not serve get a JSON 405 with
`Allow` (not http.server's HTML 501), and a misspelt `TRAINSPEC_AGENT_*` variable is named in
a warning while the agent starts anyway."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.integration.agent_process import start_agent, stop_agent
from tests.integration.jobs import free_port

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_unserved_methods_and_a_misspelt_variable(tmp_path):
    port = free_port()
    log = tmp_path / "agent.log"
    # LISTN would have moved the agent; misspelt, it stays on --listen and says so.
    agent = start_agent(
        tmp_path / "runs", port, "--no-nvml", log=log, env={"TRAINSPEC_AGENT_LISTN": "0.0.0.0:1"}
    )
    try:
        for method, path, allow in [
            ("DELETE", "/v1/actions", "GET, POST"),
            ("PUT", "/v1/trainspec/batches", "POST"),
            ("PATCH", "/metrics", "GET"),
        ]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request(method, path, body=b"{}")
                resp = conn.getresponse()
                body = resp.read()
            finally:
                conn.close()
            assert resp.status == 405, (method, path, body)
            assert resp.getheader("Allow") == allow
            assert resp.getheader("Content-Type") == "application/json"
            assert method in json.loads(body)["error"]
    finally:
        stop_agent(agent)
    warnings = [line for line in log.read_text().splitlines() if "WARNING" in line]
    assert len(warnings) == 1, warnings
    assert "TRAINSPEC_AGENT_LISTN" in warnings[0]
    assert "did you mean TRAINSPEC_AGENT_LISTEN?" in warnings[0]
