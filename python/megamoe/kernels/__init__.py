"""Launchers of the standalone component kernels (each generates its source, compiles it through megamoe.jit
and launches it)."""
