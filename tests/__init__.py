"""Test package: makes ``from tests.helpers.layouts import ...`` work under pytest and in the pooled ranks, which
import the functions they run by their module names."""
