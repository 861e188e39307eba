"""Prefect flows, Ray placement and MLflow tracking around fedcore's step functions."""
