"""Model factories: tiny test models and random-init models with real shapes (no hub downloads)."""
