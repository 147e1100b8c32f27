"""Launchers, the execute layer: start builtin engine replicas (local subprocesses or Ray
actors), tell whether one is still alive, stop it."""
