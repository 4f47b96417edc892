"""Root conftest: its presence puts tests/ on sys.path, so every suite imports the shared `ci_rule` helper."""
