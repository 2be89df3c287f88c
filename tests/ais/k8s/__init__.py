"""Tests of the real single-node Kubernetes the suite starts (``testbed/k8s/``): its build and its node."""
