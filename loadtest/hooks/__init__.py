"""Listeners that take the Locust environment: record store, /metrics scraper, merging."""
