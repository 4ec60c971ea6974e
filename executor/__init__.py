"""The bundled torch.distributed executor: trains a plan and measures it (see README.md here)."""
