"""How closely a TTS bundle of another weight or compute dtype follows the fp32 one: the backbone's hidden
states and the greedy codes per codebook, teacher-forced on the reference's own frames.

    python -m export.tts_agreement --ref BUNDLE_FP32 --bundle BUNDLE_X [--prefill-rows 48 --steps 24
                                   --seed 0 --threads 2]

A random grid prefill (text ids and audio codes in range) runs through both backbones; then at every step
the reference's depth graph picks the greedy frame from the reference's hidden state, and that frame's row
is fed to both (teacher forcing: one flipped code cannot derail what follows). Reported: the hidden state's
relative error (L2 over the hidden size, per step), and how often the bundle's own depth graph on its own
hidden state picks the reference's code, overall, per codebook and on codebook 0 (which decides EOS). A
random-weight checkpoint is not a trained model: its logit margins, not the dtype alone, set these rates.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import onnxruntime as ort

ONNX_FLOAT = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class TTSGraphs:
    """One bundle's backbone and depth graphs on the CPU provider, with a numpy KV buffer for one stream."""

    def __init__(self, bundle: Path, threads: int, capacity: int):
        manifest = json.loads((bundle / "manifest.json").read_text())
        self.cfg = manifest["tts"]["config"]
        graphs = manifest["tts"]["graphs"]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = threads
        make = lambda name: ort.InferenceSession(str(bundle / f"{graphs[name]}.onnx"), opts,
                                                 providers=["CPUExecutionProvider"])
        self.backbone, self.depth = make("backbone"), make("depth")
        kv_type = next(i.type for i in self.backbone.get_inputs() if i.name == "past_key.0")
        self.hidden_type = ONNX_FLOAT[next(i.type for i in self.depth.get_inputs() if i.name == "hidden")]
        c = self.cfg
        self.kv = np.zeros((c["layers"], 2, 1, c["kv_heads"], capacity, c["head_dim"]), ONNX_FLOAT[kv_type])
        self.length = 0

    def step(self, rows: np.ndarray) -> np.ndarray:
        """Grid rows [T, 17] after what was fed so far → the last row's hidden state [hidden] (float32); the
        graph writes its K/V into the buffer in place."""
        t = rows.shape[0]
        binding = self.backbone.io_binding()
        binding.bind_output("hidden", "cpu")
        binding.bind_cpu_input("grid", np.ascontiguousarray(rows[None], dtype=np.int64))
        binding.bind_cpu_input("position_ids", (self.length + np.arange(t, dtype=np.int64))[None])
        binding.bind_cpu_input("seqlens_k", np.array([self.length + t - 1], np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(self.kv.shape[4], np.int32))
        for layer in range(self.cfg["layers"]):
            for j, kind in enumerate(("key", "value")):
                value = ort.OrtValue.ortvalue_from_numpy(self.kv[layer, j])
                binding.bind_ortvalue_input(f"past_{kind}.{layer}", value)
                binding.bind_ortvalue_output(f"present_{kind}.{layer}", value)
        self.backbone.run_with_iobinding(binding)
        self.length += t
        return binding.get_outputs()[0].numpy()[0, -1].astype(np.float32)

    def greedy_frame(self, hidden: np.ndarray) -> np.ndarray:
        """The depth graph's greedy 16 codes for one hidden state (no repetition penalty)."""
        one = lambda v, dt: np.array([v], dt)
        feed = {"hidden": hidden[None].astype(self.hidden_type),
                "history": np.full((1, 1, self.cfg["rvq"]), self.cfg["history_pad"], np.int64),
                "repetition_penalty": one(1.0, np.float32), "temperature": one(1.0, np.float32),
                "top_k": one(0, np.int64), "top_p": one(1.0, np.float32), "greedy": one(True, np.bool_),
                "uniform": np.zeros((1, self.cfg["rvq"]), np.float32)}
        return self.depth.run(["codes"], feed)[0][0]


def random_rows(cfg: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` grid rows: a text id and ``rvq`` audio codes each, in range."""
    text = rng.integers(0, cfg["vocab"], size=(n, 1))
    codes = rng.integers(0, cfg["audio_pad"], size=(n, cfg["rvq"]))
    return np.concatenate([text, codes], axis=1).astype(np.int64)


def tts_agreement(ref_dir: Path, bundle_dir: Path, prefill_rows: int = 48, steps: int = 24, seed: int = 0,
                  threads: int = 1) -> dict:
    """Teacher-forced agreement of ``bundle_dir`` with ``ref_dir`` (see the module docstring)."""
    capacity = prefill_rows + steps + 1
    ref, other = TTSGraphs(ref_dir, threads, capacity), TTSGraphs(bundle_dir, threads, capacity)
    if ref.cfg != other.cfg:
        raise ValueError("the bundles were exported from different model configurations")
    rng = np.random.default_rng(seed)
    rows = random_rows(ref.cfg, prefill_rows, rng)
    h_ref, h = ref.step(rows), other.step(rows)
    errors, equal = [], []
    for _ in range(steps):
        errors.append(float(np.linalg.norm(h - h_ref) / np.linalg.norm(h_ref)))
        want = ref.greedy_frame(h_ref)
        equal.append(other.greedy_frame(h) == want)
        row = np.concatenate([random_rows(ref.cfg, 1, rng)[:, :1], want[None]], axis=1)
        h_ref, h = ref.step(row), other.step(row)
    agreed = np.array(equal)                                                   # [steps, codebooks]
    return {"steps": steps, "prefill_rows": prefill_rows, "seed": seed,
            "hidden_rel_error_median": statistics.median(errors), "hidden_rel_error_max": max(errors),
            "codes_equal": float(agreed.mean()), "codebook0_equal": float(agreed[:, 0].mean()),
            "per_codebook_equal": [round(float(x), 4) for x in agreed.mean(axis=0)]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export.tts_agreement", description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True, help="the fp32 TTS bundle")
    p.add_argument("--bundle", required=True, help="the TTS bundle to compare (same checkpoint)")
    p.add_argument("--prefill-rows", type=int, default=48)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: deterministic reductions)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    print(json.dumps(tts_agreement(Path(args.ref), Path(args.bundle), args.prefill_rows, args.steps, args.seed,
                                   args.threads)))


if __name__ == "__main__":
    main()
