"""torch.compile around a run: the compile cache and the warm-up that fills it."""
