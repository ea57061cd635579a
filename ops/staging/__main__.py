"""``make staging``: start the fleet, print its URLs and the commands to try, run until Ctrl-C.

Alert notifications that reach the webhook are printed as they arrive (what a pager would get).
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
from pathlib import Path

from kvops.core import runbooks
from kvops.core.errors import KvopsError
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model
from kvops.ops.staging.fleet import Fleet, FleetSpec
from kvops.ops.staging.webhook import Notification


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _print_notification(body: Notification) -> None:
    for alert in body.get("alerts", []):
        labels = alert.get("labels", {})
        _say(f"[webhook] {alert.get('status')}: {labels.get('alertname')} "
              f"instance={labels.get('instance')} model_name={labels.get('model_name', '')} "
              f"severity={labels.get('severity')}")


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="kvops-staging-"))
    _say(f"building the tiny model and starting the fleet (logs in {root}) ...")
    model = build_tiny_model(root / "model", TinyModelSpec())
    fleet = Fleet(FleetSpec(model=model, root=root, alerts=runbooks.data_path(runbooks.RULES_FILE)),
                  on_notification=_print_notification)
    try:
        fleet.start()
    except KvopsError as exc:
        sys.stderr.write(f"make staging: {exc}\n")
        return 1
    s = fleet.summary()
    _say(f"""
staging fleet is up (alerts with staging durations: for 3s, windows 15s)
  proxy (haproxy)   {s['proxy']}   model {s['model']}, API key {s['api_key']}
  replicas          {s['replicas']}
  prometheus        {s['prometheus']}
  alertmanager      {s['alertmanager']}
  webhook           {s['webhook']}

try:
  kvops diagnose --prometheus {s['prometheus']}
  kvops diagnose --url {s['proxy']}          # refused: a load balancer
  kvops loadtest kv-exhaustion --url {s['proxy']} --prometheus {s['prometheus']} \\
       --api-key {s['api_key']} --model {s['model']} --workers 2
  curl -s {s['proxy']}/v1/completions -H 'Authorization: Bearer {s['api_key']}' \\
       -H 'Content-Type: application/json' -d '{{"model": "{s['model']}", "prompt": "hello", "max_tokens": 8}}'
Ctrl-C stops everything.""")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        _say("stopping the fleet ...")
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
