"""Test package: makes ``from trident.ranks import run_distributed`` work under pytest and in the pooled ranks."""
