"""Errors that name the culprit: the file, config field, tensor key, shape or placement."""


class CheckpointError(ValueError):
    """A checkpoint directory, file or tensor is missing, malformed or does not fit the model."""


class ConfigError(ValueError):
    """A config field is missing, of the wrong type, or inconsistent with another."""


class MeshError(ValueError):
    """A mesh spec, mesh or batch that does not fit the devices or the model; names the culprit."""


class RunDirError(ValueError):
    """A run directory in use by a running run, or holding an earlier run's files; a resume
    whose settings differ from the run's."""
