"""The intra-op pools of a bundle's sessions: a frame runs several sessions in turn, so none may spin."""

from __future__ import annotations

from conftest import TEST_DEVICE

from engine.bundle import Bundle


def test_no_session_of_a_bundle_spins_its_pool_after_a_run(full_bundle_dir):
    """Every graph's session is made with spinning off: the backbone step, depth and codec run one after
    another on the same cores, and a pool spinning after its run slowed the next session's (docs/performance.md,
    Thread pools: the steady frame 237 -> 206 ms at real dimensions). Checked on the sessions onnxruntime made,
    not on the options we meant to give it."""
    bundle = Bundle(full_bundle_dir, device=TEST_DEVICE, threads=2)
    names = sorted(bundle.info.graphs)
    assert {"backbone", "depth", "codec_decoder"} <= set(names), names
    for name in names:
        options = bundle.session(name).get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0", name
        assert options.intra_op_num_threads == 2, name
