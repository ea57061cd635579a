"""Locust users, shapes, scenarios, metrics scraping and reports; never imports vLLM or torch."""
