"""Importers: other tools' profile formats -> :class:`partitioner.profile.Profile`."""
