"""Factory next to local_helpers.yaml: importable only through the config's source_dir."""


def make(model_path: str | None = None) -> dict:
    return {"model_path": model_path}
