"""Test package: makes ``from tests.dist import run_distributed`` work under pytest and in the pooled ranks."""
