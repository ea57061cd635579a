"""Locust users: what a virtual user sends and how it measures it."""
