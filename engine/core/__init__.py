"""The engine core: the scheduler, the runner, admission, the KV pool, parking and the prefix cache of one
bundle, run in a process of its own (``python -m engine.core``) behind a typed client, or in-process.

:mod:`engine.core.local` is the engine itself (what either runs), :mod:`engine.core.wire` what crosses
between the processes, :mod:`engine.core.process` the core process and :mod:`engine.core.client` the API
process's side of it.
"""
