"""A run's settings: one validated :class:`~mpidist.settings.config.Settings` and the model specifications.

``Settings`` is generated from the strategy registry (each strategy declares
its own options), so this layer sits above :mod:`mpidist.parallel`.
"""
