"""Test package: makes ``from tests.layouts import ...`` work under pytest and in the pooled ranks, which import the
functions they run by their module names."""
