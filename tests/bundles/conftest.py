"""Fixtures of the bundle tests: the CIFAR bundles run on the tiny fake CIFAR of the package tests."""
from tests.cifar_baselines.conftest import fake_cifar  # noqa: F401  (a fixture, used by name)
