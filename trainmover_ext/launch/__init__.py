"""``trainmover launch``: a torchrun-like agent that starts, supervises and restarts ranks."""
