"""The Wyoming protocol (Home Assistant's voice services) in the serve process: ``describe`` → ``info`` with every
voice, ``synthesize``, and ``synthesize-start``/``-chunk``/``-stop`` with text streamed in as it arrives. One
more adapter on :mod:`app.session`; see docs/wyoming.md."""
