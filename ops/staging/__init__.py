"""A staging fleet of real parts on loopback: vLLM replicas behind haproxy, Prometheus scraping
them with the runbook alerts, Alertmanager delivering to a local webhook.

Started by ``make staging`` (``python -m kvops.ops.staging``) and by the e2e tests' session
fixture, so an SRE's commands and the tests meet the same stack.
"""
