"""A real single-node Kubernetes for the tests: its binaries (``build``) and the node that runs them."""
