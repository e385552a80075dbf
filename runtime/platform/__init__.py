"""Platform layer: what differs between ROCm, CUDA and CPU, in one place.

`rlkube.runtime.platform.env` holds the pure env tables (no torch import) that the operator
renders into pod specs; the probing registry builds on them.
"""
