"""Datasets, built-in tasks and preprocessors."""
