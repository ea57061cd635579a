"""Configuration files of the staging fleet's Debian daemons, rendered from a few numbers.

Pure functions (text in, text out) so the unit tests can check them without starting anything.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import yaml

# Staging shortens every `for:` and every range window so an alert fires and resolves within
# seconds of the state that causes it (production keeps the minutes of runbooks/alerts.yaml).
FAST_FOR = "3s"
FAST_WINDOW = "15s"
_RANGE = re.compile(r"\[(\d+)([smh])\]")
"""Rate windows; day-long windows are label lookbacks (KvopsVllmDown's model_name) and stay."""
_OFFSET = re.compile(r"offset \d+[smhd]")


def fast_rules(alerts_yaml: str, for_: str = FAST_FOR, window: str = FAST_WINDOW) -> str:
    """alerts.yaml with short `for:` durations and short range windows (same expressions
    otherwise): the staging rule file."""
    data = yaml.safe_load(alerts_yaml)
    for group in data["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = for_
            rule["expr"] = _OFFSET.sub(f"offset {window}", _RANGE.sub(f"[{window}]", rule["expr"]))
    out: str = yaml.safe_dump(data, sort_keys=False, width=120)
    return out


def prometheus_yml(targets: Sequence[str] | str, rules_file: str, alertmanager: str | None,
                   interval_s: int = 1, job: str = "vllm") -> str:
    """Scrape the replicas every ``interval_s`` and evaluate the rules as often.

    ``targets`` given as a path is a file_sd list (JSON) Prometheus rereads when it changes: the
    way service discovery adds and loses targets. No ``alertmanager``: alerts stay in Prometheus."""
    discovery = ({"file_sd_configs": [{"files": [targets], "refresh_interval": f"{interval_s}s"}]}
                 if isinstance(targets, str) else {"static_configs": [{"targets": list(targets)}]})
    config: dict[str, object] = {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s",
                   "scrape_timeout": f"{interval_s}s"},
        "rule_files": [rules_file],
        "scrape_configs": [{"job_name": job, **discovery}],
    }
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    out: str = yaml.safe_dump(config, sort_keys=False)
    return out


def alertmanager_yml(webhook_url: str) -> str:
    """One webhook receiver, grouped per alert and replica, resolved alerts delivered too.

    The inhibition rules are those runbooks/README.md documents: a replica that is down mutes
    every other alert of that replica, and an LMCache server that is down mutes the connector's
    degraded alert of the same replica (one incident pages once)."""
    config = {
        "route": {"receiver": "webhook", "group_by": ["alertname", "job", "instance"],
                  "group_wait": "1s", "group_interval": "2s", "repeat_interval": "1h"},
        "receivers": [{"name": "webhook",
                       "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
        "inhibit_rules": INHIBIT_RULES,
    }
    out: str = yaml.safe_dump(config, sort_keys=False)
    return out


INHIBIT_RULES: list[dict[str, object]] = [
    {"source_matchers": ['alertname="KvopsVllmDown"'],
     "target_matchers": ['alertname=~"Kvops.+"', 'alertname!="KvopsVllmDown"'],
     "equal": ["job", "instance"]},
    {"source_matchers": ['alertname="KvopsOffloadServerDown"'],
     "target_matchers": ['alertname=~"KvopsOffloadDegraded|KvopsOffloadErrors|KvopsOffloadLoadPathBroken"'],
     "equal": ["job", "instance"]},
]


def haproxy_cfg(port: int, backends: Sequence[tuple[str, str]], monitor_uri: str = "/haproxy-health") -> str:
    """Round-robin HTTP balancing over ``backends`` (name, host:port), health-checked on
    vLLM's /health; ``monitor_uri`` answers 200 while haproxy itself runs."""
    servers = "\n".join(f"    server {name} {addr} check inter 1s fall 2 rise 1"
                        for name, addr in backends)
    return f"""global
    maxconn 512

defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    option http-server-close

frontend fleet
    bind 127.0.0.1:{port}
    monitor-uri {monitor_uri}
    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk GET /health
{servers}
"""
